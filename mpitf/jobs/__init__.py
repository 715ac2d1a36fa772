"""The built-in training jobs, each a module with ``main(argv)`` and a command-line ``run()``.

``mpitf run -n 3 mnist_mlp ...`` starts ``python -m mpitf.jobs.mnist_mlp ...`` on every rank;
the scripts under a checkout's ``jobs/`` call the same ``run()``, so both ways run one code.
"""
