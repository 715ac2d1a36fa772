"""A node's cores shared among its ranks: the one rule the ps, torch and jax all use."""

from mpitf.runtime.cores import launcher_local_ranks, node_share, ranks_on_host, usable_cores


def test_each_rank_gets_its_share_of_the_node_s_cores():
    cores = usable_cores()
    assert cores >= 1
    hosts = ["a", "b", "a", "a"]
    assert (ranks_on_host(hosts, 0), ranks_on_host(hosts, 1)) == (3, 1)
    assert node_share(1) == cores and node_share(3) == max(1, cores // 3)
    assert node_share(10 * cores) == 1  # never none
    assert launcher_local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4
    assert launcher_local_ranks({}) == 1
