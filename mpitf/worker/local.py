"""A worker's side of local SGD: its own optimizer steps, its parameters pushed every K.

Under ``--mode local`` (:class:`~mpitf.modes.Local`) a worker applies each step's gradient
to its own copy of the parameters, the frames the ps's replies land in, with the ps's own
update rules and kernels (the optimizer's ``bind_shard``, per ps shard, over that ps's
variable layout), so a worker's step is the step a ps would take. Every ``local_steps``
steps (and at the last) it pushes the parameters in place of a gradient, marked with the
step it reached; the ps (:mod:`mpitf.ps.local`) answers with every worker's mean, which
lands in the same frames. The optimizer's slots stay on the worker, and a checkpoint holds
the averaged parameters (a resume starts the slots afresh: exact for plain SGD).
"""


class LocalSteps:
    """The optimizer run on this worker's copy of each ps's shard (see the module docstring)."""

    def __init__(self, client, optimizer):
        self.client = client
        self.optimizer = optimizer
        params = client.layout.payloads(client.params_flat)
        self.grads = client.grad_layout.payloads(client.grads_flat)  # one frame per ps
        self.params = params
        self.updates = [optimizer.bind_shard(client.placement.slices_for_ps(p), params[p])
                        for p in range(len(params))]

    def step(self, global_step):
        """Apply this step's gradient to the worker's parameters (``global_step``: before it).

        The rates a front end set for this step (mpitf.torch's schedulers) are taken as a
        ps takes a push's: the one rate, or each group's.
        """
        client = self.client
        rates = client.rates
        if rates.learning_rate is not None:
            self.optimizer.set_learning_rate(rates.learning_rate)
        if rates.values is not None:
            self.optimizer.set_learning_rates(rates.values)
        if client.grad_views.split:  # partitioned variables: their gradients into the frames
            client.grad_views.scatter()
        for update, grad in zip(self.updates, self.grads):
            update(grad, global_step)
        if client.param_views.split:
            client.param_views.gather()

    def push(self, step, data_position):
        """Push the parameters, reached at global step ``step``; return the handle.

        They travel in the gradient frames, whose headers say ``step`` (each ps's last
        reply step is replaced by it: the ps averages the pushes of one step).
        """
        client = self.client
        for grad, params in zip(self.grads, self.params):
            grad[...] = params
        for name, _ in client.grad_views.split:  # the push scatters these from the model's
            client.grads[name][...] = client.params[name]
        client.link.steps[:] = [step] * len(self.params)
        return client.push_pull(data_position)
