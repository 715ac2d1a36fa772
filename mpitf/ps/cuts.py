"""The ps's side of a checkpoint cut: restore its shard, save it once every worker paused.

:class:`Cuts` is mixed into :class:`~mpitf.ps.service.Service`. The chief asks for a cut;
each worker pauses after its push of that step, and when all have, each ps writes its
shard, slots, tables and the workers' data positions (:mod:`mpitf.ckpt.cut`).
"""

from ..ckpt import cut


class Cuts:
    """The Service's checkpoint duties (see the module docstring)."""

    def _restore(self, state, ckpt_dir):
        """Load this ps's part of the checkpoint in ``ckpt_dir``; serve from its step."""
        shard = self.shard
        average = shard.average_frame.payload if shard.average is not None else None
        # --reset-optimizer-state: the slots start as new (the chief said so in the log)
        slots = {} if self.config.reset_optimizer_state else shard.saved_slots()
        restored = cut.restore_shard(ckpt_dir, shard.slices, self.backend, shard.params,
                                     slots, average,
                                     self.tables.targets() if self.tables else None)
        if self.tables:
            self.tables.checkpointed()  # the restored rows are the checkpoint's
        if restored["missing_average"]:
            shard.start_average()
        shard.restored()
        state.global_step = restored["global_step"]
        self.pipeline.at_step(state.global_step)
        state.positions = restored["positions"]
        state.initialized = True
        self.write_header()

    def _save(self, state):
        """Write this ps's part of the cut (every worker paused at the same step)."""
        if self.sparse is not None:
            self.sparse.flush()
        shard = self.shard
        average = shard.average_frame.payload if shard.average is not None else None
        cut.save_shard(self.comm, state.chief, self.config.checkpoint_dir, self.ps_task,
                       self.assignment.num_ps, self.cut_state.global_step, shard.slices,
                       self.backend, shard.params, shard.saved_slots(), average, state.positions,
                       state.paused, state.counters,
                       self._saved_tables(state.global_step), peer=self.server.peer)
        if self.tables:
            self.tables.checkpointed()

    def _saved_tables(self, step):
        """Return this ps's rows of the tables for the cut: all, or the changed (a delta)."""
        if not self.tables:
            return None
        return self.tables.saved(step, delta=self.delta_cut)

    def _check_quiescent(self, state):
        """Save (or heal) once every worker is paused or done, then let them go on."""
        quiet = all(w in state.done or w in state.paused for w in range(self.num_workers))
        if state.healing and quiet and not state.pausing:
            if not self.is_ward:  # a served copy's buddy heals for both
                self.heal(state)
            return
        if state.pausing and quiet:
            self._finish_replies()
            self._save(state)
            state.pausing = False
            state.paused.clear()
            self.write_header()
