"""ductile's integrations with the training frameworks users bring.

A ``runtime = "torchrun"`` job with ``[program] integrations = ["transformers"]`` has its
launcher call :func:`install` before the script runs (``DUCTILE_INTEGRATIONS`` names them), so an
unmodified Hugging Face ``Trainer`` script:

- reports each step (and each logged loss) to ductile: ``dctl status`` shows its progress;
- saves a checkpoint at the next step when ductile gives notice that the world will change (a
  drain, a spot notice, a ``dctl scale``): a planned change loses nothing;
- resumes from the newest complete checkpoint in its ``output_dir`` when the script names none
  (``trainer.train()`` with no ``resume_from_checkpoint``): a restarted world goes on where the
  last checkpoint left it instead of starting from step 0; a world restarted after its last
  save (a rank that failed on its way out) ends there, with no step past ``max_steps``.

A ``runtime = "tf"`` job with ``integrations = ["keras"]`` gets a callback in every Keras
``model.fit`` that reports its steps and losses (its resumption is Keras' own
``BackupAndRestore``).

A script may do the same by hand: ``trainer.add_callback(ductile.integrations.DuctileCallback())``
and ``trainer.train(resume_from_checkpoint=ductile.integrations.last_checkpoint(args.output_dir))``.
Outside ductile every report is a no-op and nothing is resumed that the script did not ask for.
"""

import os
import re
import sys

from . import in_ductile, preempted, report, saved

__all__ = ["install", "install_keras", "install_transformers", "last_checkpoint", "DuctileCallback"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# what the Trainer writes last in a checkpoint (after the weights, optimizer and RNG states)
_COMPLETE = "trainer_state.json"


def last_checkpoint(output_dir):
    """The newest complete ``checkpoint-N`` directory under ``output_dir`` (its
    ``trainer_state.json`` written), or None."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    best = None
    for name in os.listdir(output_dir):
        m = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, _COMPLETE)):
            n = int(m.group(1))
            if best is None or n > best[0]:
                best = (n, path)
    return best[1] if best else None


def _agreed(flag):
    """``flag`` raised on any rank, on every rank (one small all-reduce when the world has
    more than one process); ``flag`` alone outside torch.distributed."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return flag
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flag
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _callback_class():
    from transformers import TrainerCallback

    class DuctileCallback(TrainerCallback):
        """Reports a ``Trainer``'s steps and losses to ductile, and saves at the next step
        once ductile gives notice of a planned change of the world."""

        def __init__(self):
            self._last_step = None
            self._saved_for_notice = False
            # the last logged loss rides on every step's report
            self._loss = None

        def _samples(self, args, step):
            per_step = (
                args.per_device_train_batch_size
                * max(1, args.gradient_accumulation_steps)
                * max(1, args.world_size)
            )
            done = 0 if self._last_step is None else max(0, step - self._last_step)
            self._last_step = step
            return float(done * per_step) if done else None

        def on_train_begin(self, args, state, control, **kwargs):
            self._last_step = state.global_step
            if state.is_world_process_zero and state.global_step > 0:
                report(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                report(
                    state.global_step,
                    loss=self._loss,
                    samples=self._samples(args, state.global_step),
                )
            # every rank sees the notice, each at its own moment; the save is collective (a
            # rank alone in it waits for the others, which train on): the ranks agree on the
            # step, as Accelerate's check_trigger does
            if _agreed(preempted() and not self._saved_for_notice):
                self._saved_for_notice = True
                control.should_save = True
                print(
                    f"ductile: notice of a change of the world: saving at step {state.global_step}",
                    file=sys.stderr,
                    flush=True,
                )
            return control

        def on_save(self, args, state, control, **kwargs):
            # the notice's save is complete: the change of the world need not wait longer
            if self._saved_for_notice and state.is_world_process_zero:
                saved(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                self._loss = float(logs["loss"])
                report(state.global_step, loss=self._loss)

    return DuctileCallback


def __getattr__(name):
    # `ductile.integrations.DuctileCallback` imports transformers only when asked for
    if name == "DuctileCallback":
        return _callback_class()
    raise AttributeError(name)


_installed = set()


def install_transformers():
    """Add a :class:`DuctileCallback` to every ``transformers.Trainer`` and resume from the
    newest complete checkpoint of its ``output_dir`` when ``train()`` is given none."""
    if "transformers" in _installed:
        return
    import transformers

    cls = _callback_class()
    trainer = transformers.Trainer
    init, train = trainer.__init__, trainer.train

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        if not any(isinstance(c, cls) for c in self.callback_handler.callbacks):
            self.add_callback(cls())

    def train_(self, resume_from_checkpoint=None, *a, **kw):
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            found = last_checkpoint(self.args.output_dir)
            if found:
                print(f"ductile: resuming from {found}", file=sys.stderr, flush=True)
                resume_from_checkpoint = found
                done = _finished(self, found)
                if done is not None:
                    return done
            elif resume_from_checkpoint is False:
                resume_from_checkpoint = None
        return train(self, resume_from_checkpoint, *a, **kw)

    trainer.__init__ = __init__
    trainer.train = train_
    _installed.add("transformers")


def _finished(trainer, checkpoint):
    """When ``checkpoint`` already holds the run's last step (a world restarted after its final
    save, e.g. a rank that failed on its way out): the checkpoint's weights and state loaded
    and the ``TrainOutput`` returned, with no step taken. ``Trainer.train`` resumed there would
    train one step past ``max_steps`` when ``max_steps`` is not a whole number of epochs (it
    checks the limit only after a step). None when there are steps left to train."""
    from transformers import TrainerState
    from transformers.trainer_utils import TrainOutput

    if trainer.args.max_steps is None or trainer.args.max_steps <= 0:
        # an epoch-bounded run resumed at its end trains no step: Trainer's own loop is exact
        return None
    state = TrainerState.load_from_json(os.path.join(checkpoint, _COMPLETE))
    if state.global_step < trainer.args.max_steps:
        return None
    trainer._load_from_checkpoint(checkpoint)
    trainer.state = state
    print(
        f"ductile: {checkpoint} is the run's last step ({state.global_step} of max_steps "
        f"{trainer.args.max_steps}): its weights loaded, no step trained",
        file=sys.stderr,
        flush=True,
    )
    if trainer.is_world_process_zero():
        report(state.global_step)
    losses = [h["loss"] for h in state.log_history if "loss" in h]
    loss = sum(losses) / len(losses) if losses else 0.0
    return TrainOutput(state.global_step, loss, {"train_loss": loss})


def _keras_callback_class(keras):
    import tensorflow as tf

    class DuctileKerasCallback(keras.callbacks.Callback):
        """Reports a Keras ``model.fit``'s steps (the optimizer's ``iterations``: a run
        resumed by ``BackupAndRestore`` goes on from its backup's step) and losses to
        ductile; once ductile gives notice of a planned change of the world, backs up at the
        next step through the ``fit``'s ``BackupAndRestore`` callbacks (``backups``) and says
        so (``ductile.saved``)."""

        def __init__(self, backups=()):
            super().__init__()
            self._backups = list(backups)
            self._noticed = False
            self._agree = None

        def on_train_begin(self, logs=None):
            step = self._step()
            if step:
                report(step)

        def on_train_batch_end(self, batch, logs=None):
            loss = (logs or {}).get("loss")
            step = self._step()
            report(step, loss=None if loss is None else float(loss))
            if self._backups and not self._noticed and self._agreed(preempted()):
                self._noticed = True
                for b in self._backups:
                    b._backup(epoch=b._current_epoch, batch=batch)
                print(
                    f"ductile: notice of a change of the world: backed up at step {step}",
                    file=sys.stderr,
                    flush=True,
                )
                if os.environ.get("RANK", "0") == "0":
                    saved(step)

        def _step(self):
            try:
                return int(self.model.optimizer.iterations.numpy())
            except Exception:
                return 0

        def _agreed(self, flag):
            """``flag`` raised on any worker, on every worker: one small all-reduce of the
            model's strategy (a compiled function: about 2 ms a step between two CPU workers
            on one host), each worker at the same batch."""
            strategy = self.model.distribute_strategy
            if strategy.num_replicas_in_sync <= 1:
                return flag
            if self._agree is None:

                @tf.function
                def agree(x):
                    per_replica = strategy.run(lambda: tf.identity(x))
                    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

                self._agree = agree
            return int(self._agree(tf.constant(1 if flag else 0, tf.int32)).numpy()) > 0

    return DuctileKerasCallback


def install_keras():
    """Add ductile's callback to every Keras ``model.fit``: Keras 2 (``tf_keras``, what
    ``tf.keras`` is under ``TF_USE_LEGACY_KERAS=1``, and what ``MultiWorkerMirroredStrategy``'s
    ``model.fit`` runs on) when it is installed, and Keras 3 (``keras``) unless the legacy
    switch is on. A program that names no callback of ours gets one; one that does is left as
    it is."""
    if "keras" in _installed:
        return
    import importlib
    import importlib.util

    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    names = [n for n in ("tf_keras", "keras") if importlib.util.find_spec(n) is not None]
    if legacy:
        names = [n for n in names if n != "keras"]
    if not names:
        raise ImportError("the keras integration needs tf_keras or keras installed")
    for name in names:
        keras = importlib.import_module(name)
        _patch_fit(keras, _keras_callback_class(keras))
    _installed.add("keras")


def _patch_fit(keras, cls):
    fit = keras.Model.fit

    def with_ours(callbacks):
        callbacks = list(callbacks or [])
        if not any(isinstance(c, cls) for c in callbacks):
            # Keras 2's BackupAndRestore backs up on demand (``_backup``); Keras 3's does not
            backups = [
                c
                for c in callbacks
                if isinstance(c, keras.callbacks.BackupAndRestore) and hasattr(c, "_backup")
            ]
            callbacks.append(cls(backups))
        return callbacks

    def fit_(self, *a, **kw):
        # callbacks is fit's sixth parameter (x, y, batch_size, epochs, verbose, callbacks)
        if len(a) >= 6:
            a = list(a)
            a[5] = with_ours(a[5])
        else:
            kw["callbacks"] = with_ours(kw.get("callbacks"))
        return fit(self, *a, **kw)

    keras.Model.fit = fit_


_INTEGRATIONS = {"transformers": install_transformers, "keras": install_keras}


def missing(names=None):
    """The Python packages the integrations ``names`` (default: ``DUCTILE_INTEGRATIONS``) need
    that this interpreter cannot import, found without importing them (``find_spec``): what the
    launcher checks once before a program starts, so that a job whose interpreter lacks one is
    refused naming it rather than restarted. An alternative (Keras 2 or 3) reads ``a or b``."""
    import importlib.util

    if names is None:
        names = [n for n in os.environ.get("DUCTILE_INTEGRATIONS", "").split(",") if n]
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    needs = {
        # Trainer imports accelerate and torch when it is made
        "transformers": [("transformers",), ("accelerate",), ("torch",)],
        "keras": [("tensorflow",), ("tf_keras",) if legacy else ("tf_keras", "keras")],
    }
    out = []
    for n in names:
        for alternatives in needs.get(n, []):
            if not any(importlib.util.find_spec(a) is not None for a in alternatives):
                out.append(" or ".join(alternatives))
    return out


def install(names=None):
    """Install the integrations ``names`` (default: ``DUCTILE_INTEGRATIONS``, comma-separated).
    An unknown name, or a framework that is not installed, raises: a job that asked for an
    integration does not run without it."""
    if names is None:
        names = [n for n in os.environ.get("DUCTILE_INTEGRATIONS", "").split(",") if n]
    for n in names:
        if n not in _INTEGRATIONS:
            raise ValueError(f"ductile: unknown integration {n!r} (known: {', '.join(_INTEGRATIONS)})")
        _INTEGRATIONS[n]()
    return bool(names) and in_ductile()
