"""Train and validate the TensorFlow 3D U-Net of one trial from the search's TFRecords.

The loop is a plain ``tf.function`` step over a ``tf.data`` pipeline rather than ``model.fit``:
each epoch hands back its numbers to whoever drives it (a Ray Tune trial), and the same step
can later run under a ``tf.distribute`` strategy.

Validation is per case on whole volumes (by sliding windows of the tile when ``training.tile`` is set), so
the validation dice is the one a user would compute on the preprocessed cases.

Mixed precision (``training.precision``): ``bf16`` and ``fp16`` build the U-Net with the Keras dtype policy
``mixed_bfloat16`` or ``mixed_float16`` given to each layer (never Keras's global policy: the next trial built in
the process is not changed), float32 variables and a float32 head, so the probabilities and the loss are float32;
fp16 wraps the optimizer in a ``LossScaleOptimizer`` whose scaled loss the step differentiates (it unscales the
gradients, skips a step that overflowed and keeps its scale among the optimizer's variables, so checkpoints hold it).

The optimizer is ``training.optimizer``'s (:mod:`distmis.train.optimizers`). Keras's ``weight_decay`` is decoupled,
so the coupled L2 of ``adam`` and ``sgd`` is added to the gradients by the step itself, before ``apply_gradients``.
TensorFlow's CPU kernels have no float16 max pooling: fp16 needs a GPU (refused otherwise, here and by the spec's
checks). The precision is part of :func:`graph_key`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from distmis.data.manifest import DataManifest
from distmis.models.registry import NetworkInput
from distmis.networks import build_network
from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec
from distmis.spec.curriculum import TrainingStage, inference_window, stage_at
from distmis.train.epoch import (
    EpochMetrics, NonFiniteLossError, ValidationScores, checked_epoch, curriculum_metrics, trainer_targets,
    trial_parts,
)
from distmis.train.inference import predict_channels_last
from distmis.train.clipping import clip_tf_gradients
from distmis.train.choice_cache import ChoiceCache, cache_key, cpu_model
from distmis.train.compile_choice import CompileChoice, XlaProbe, compile_cache_entry
from distmis.train.optimizers import keras_optimizer, optimizer_entry, with_l2
from distmis.train.schedules import LearningRateSchedule
from distmis.train.tf_metering import AllocatorMeter, allocator_device

__all__ = ["EpochMetrics", "NonFiniteLossError", "UNetTrainer", "graph_key"]

logger = logging.getLogger(__name__)


def _variable_bytes(variable: Any) -> int:
    return int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


def _release_in_background(iterator: Any) -> None:
    """Drop the last reference to an endless input iterator in a thread of its own: its destructor joins the
    pipeline's threads (1 to 14 s on a worker of 1 CPU while tf.data's autotuning thread ran, which waited out its
    optimization period; :func:`~distmis.data.tfrecord.make_dataset` now runs without it), which the next trial
    need not wait for."""
    if iterator is None:
        return
    held = [iterator]
    del iterator
    threading.Thread(target=held.clear, name="distmis-drop-iterator", daemon=True).start()


def _worker_of(strategy: Any) -> tuple[int, int] | None:
    """``(workers, this worker's index)`` of a multi-worker strategy's cluster (``TF_CONFIG``); None otherwise."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return None
    spec = resolver.cluster_spec()
    workers = sum(spec.num_tasks(job) for job in spec.jobs if job in ("chief", "worker"))
    index = int(resolver.task_id) + (1 if resolver.task_type == "worker" and "chief" in spec.jobs else 0)
    return workers, index


def seed_everything(seed: int) -> None:
    """``keras.utils.set_random_seed(seed)``, but TensorFlow's global seed is set only when it changes.

    Setting TensorFlow's seed clears its kernel cache, so every traced function of the process (a kept trainer's
    training step: :meth:`UNetTrainer.restart`) is instantiated and optimized again at its next call: 1.7 s on one
    worker for the U-Net of benchmarks/speedup.yaml, about 4 s for its 2-worker ``MultiWorkerMirroredStrategy``
    step. With the same seed in place the pipelines' seeded shuffles and tiles draw as after a full reset, and
    Python's and NumPy's seeds (the U-Net's initial weights draw from Python's) are set again. Keras's global
    ``SeedGenerator``, which only unseeded ``keras.random`` calls use (the U-Net makes none), is not reset then.
    """
    import random

    import keras
    import tensorflow as tf

    global_seed, _ = tf.compat.v1.random.get_seed(0)  # with an op seed given nothing is drawn
    if global_seed == seed % (2**31 - 1):  # TensorFlow's truncation of seeds
        random.seed(seed)
        np.random.seed(seed)
    else:
        keras.utils.set_random_seed(seed)


def graph_key(spec: Spec) -> str:
    """What a trainer's traced graphs depend on: the spec but its learning rate and its schedule (a variable the
    graphs read), seed, number of epochs, tile sampling and augmentation (the input pipeline's, made again at a
    restart; augmentation keeps the inputs' shapes), and the fold a cross-validation trial validates on
    (``dataset.split.fold``: a restart reads the new fold's cases; the graphs do not depend on which cases they
    see): two trials with equal keys can share one trainer (:meth:`UNetTrainer.restart`). ``training.precision`` is
    part of it: a trainer traced in fp32 is never restarted for a bf16 trial."""
    training = spec.training.model_dump(mode="json",
                                        exclude={"epochs", "seed", "lr_schedule", "tile_sampling", "augment"})
    training["optimizer"].pop("lr")
    dataset = spec.dataset.model_dump(mode="json", exclude={"split": {"fold"}})
    return json.dumps({"model": spec.model.model_dump(mode="json"), "dataset": dataset, "training": training},
                      sort_keys=True)


class UNetTrainer:
    """Builds the U-Net, its optimizer and data pipelines for one trial's spec: a
    :class:`~distmis.train.protocol.RestartableTrainer` (the :class:`~distmis.train.protocol.Trainer` contract, and
    :meth:`restart` for the worker group of a data-mode search)."""

    def __init__(self, spec: Spec, tfrecord_dir: str | Path, *, layout: TrialLayout,
                 strategy: Any | None = None):
        """``layout``: the trial's layout, resolved once for the trial by its caller
        (:func:`~distmis.spec.layout.resolve_trial`); the optimizer takes its ``effective_lr``.
        ``strategy``: a ``tf.distribute`` strategy (``MultiWorkerMirroredStrategy`` in a data-parallel
        trial); None runs on this process alone. Each replica takes ``training.batch_size`` volumes a step."""
        import keras
        import tensorflow as tf

        from distmis.data.cases import SplitCases
        from distmis.data.targets import metric_keys
        from distmis.data.manifest import read_manifest
        from distmis.models.unet3d_tf import count_trainable_parameters
        from distmis.parallel.tensorflow_cluster import broadcast_from_first_replica, variables_without_broadcast
        from distmis.train.losses import make_loss

        self.spec = spec
        self.layout = layout
        self.tfrecord_dir = Path(tfrecord_dir)
        manifest = read_manifest(self.tfrecord_dir)
        self.num_classes = manifest.num_classes
        self.in_channels = manifest.in_channels
        # What the output channels mean (distmis.data.targets): the head's activation, the loss, the scored channels
        self.targets = trainer_targets(manifest, self.tfrecord_dir)
        self.activation: str = self.targets["activation"]
        self.metric_keys: list[str] = metric_keys(self.targets)
        training = spec.training

        if training.precision == "fp16" and not tf.config.list_physical_devices("GPU"):
            raise ValueError("training.precision 'fp16' with TensorFlow needs a GPU: TensorFlow has no CPU float16 "
                             "kernel for the U-Net's max pooling (MaxPool3D), and this process sees no GPU. Use "
                             "'bf16' on CPUs")
        self.strategy = strategy or tf.distribute.get_strategy()
        self.replicas = int(self.strategy.num_replicas_in_sync)
        # Same seed -> same initial weights and data order, whatever hyperparameters differ.
        seed_everything(training.seed)
        with self.strategy.scope(), variables_without_broadcast(self.strategy):
            self.model, self.optimizer = self._build(keras, manifest)
            # The optimizer's slots (Adam's moments, SGD's momentum) made here, eagerly: made inside the first traced
            # step, they cost a second trace of it and graph-mode initializers (9.8 s of tracing against 3.1 s for
            # the U-Net of benchmarks/speedup.yaml)
            self.optimizer.build(self.model.trainable_variables)
        # The first worker's initial weights to all, in one collective (the optimizer's state starts at zero)
        broadcast_from_first_replica(self.strategy, self.model.weights)
        self.num_parameters = count_trainable_parameters(self.model)
        self.loss_fn = make_loss(training.loss.name, smooth=training.loss.smooth, activation=self.activation)
        # training.lr_schedule at the layout's (data-parallel scaled) rate, assigned to the optimizer's
        # learning-rate variable at each epoch's start or step: no graph is traced again for it
        self.learning_rates = LearningRateSchedule.for_training(training, self.layout.effective_lr)
        self._epochs_trained = 0
        self._predictions: dict[tuple, dict[str, float]] = {}  # memory_metrics' predictions, by stage input
        # train / val, or with cross-validation (dataset.split.fold) the other folds / this trial's fold
        self.parts = trial_parts(manifest, spec.dataset.split.fold, self.tfrecord_dir)
        self._num_train = self.parts.num_train
        self.volume_shape = manifest.volume
        # training.curriculum: the stage of the epoch being trained gives the tile, batch and tile sampling (a spec
        # without one is one stage); validation and inference use the last stage's input throughout.
        self.stage = stage_at(training, 1)
        self.window = inference_window(training)
        self.train_data = self._train_data(training.seed)
        # Validation cases are read one at a time when predicted (each epoch), as in the torch trainers.
        self.val_cases = SplitCases(self.tfrecord_dir, self.parts.val, label_dtype=np.float32, manifest=manifest)
        if not self.val_cases:
            raise ValueError(f"{self.tfrecord_dir}: the validation split holds no cases")

        model, optimizer, loss_fn, strategy = self.model, self.optimizer, self.loss_fn, self.strategy
        replicas = self.replicas
        loss_scaling = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)  # fp16
        # adam's and sgd's weight decay: L2 added to each gradient (Keras's own weight_decay is decoupled)
        l2 = optimizer_entry(training.optimizer.name).gradient_l2(training.optimizer)
        clip = training.clip_grad_norm

        def train_step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                    scaled = loss / replicas  # gradients are summed over replicas: average them
                    if loss_scaling:  # apply_gradients unscales them (and skips a step that overflowed)
                        scaled = optimizer.scale_loss(scaled)
                grads = tape.gradient(scaled, model.trainable_variables)
                if clip is not None:  # the trial's gradient clipped to its global norm, before the L2 term (torch's)
                    grads = clip_tf_gradients(grads, clip, replicas=replicas,
                                              loss_scale=optimizer.scale_loss(1.0) if loss_scaling else 1.0)
                if l2:  # wd * w in all, each replica's share, loss-scaled as the gradients still are (fp16)
                    grads = with_l2(grads, model.trainable_variables, l2, optimizer=optimizer, replicas=replicas)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            per_replica = strategy.run(replica_step, args=(x, y))
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

        self._replica_train_step = train_step

        @tf.function(reduce_retracing=True)
        def predict(x):
            return model(x, training=False)

        @tf.function
        def train_steps(iterator, learning_rates):
            """A step per rate of ``learning_rates`` from a distributed ``iterator`` in one graph, so that no
            ``next`` is an eager cross-worker check for the end of the data (the mean loss of the steps)."""
            total = tf.constant(0.0)
            steps = tf.shape(learning_rates)[0]
            for step in tf.range(steps):
                optimizer.learning_rate = learning_rates[step]
                x, y = next(iterator)
                total += train_step(x, y)
            return total / tf.cast(steps, tf.float32)

        self.compile, self._xla_probe = self._compile_choice()
        self._trace_train_step()
        self._train_steps = train_steps
        self._train_iterator: Any = None
        #: the last epoch's training steps' share of its training time (the rest: waiting for the input pipeline)
        self.step_share: float | None = None
        self._predict = predict

    def _compile_choice(self) -> tuple[CompileChoice, XlaProbe | None]:
        """``training.performance.compile`` for this trainer: ``on`` is XLA (``jit_compile``) for a trial of one
        replica, ``off`` the traced graph; ``auto`` measures XLA against the graph on the trial's own steps
        (:class:`~distmis.train.compile_choice.XlaProbe`, for a long enough trial of one replica; a trial over
        several replicas runs its graph)."""
        import tensorflow as tf

        asked = self.spec.training.performance.compile
        if asked == "on" and self.replicas > 1:
            raise ValueError("training.performance.compile 'on' (XLA) is for a TensorFlow trial of one replica; this "
                             f"one has {self.replicas}: use 'auto'")
        if asked != "auto":
            return CompileChoice(asked == "on", "set"), None
        if self.replicas > 1 or not isinstance(self.train_data, tf.data.Dataset):
            return CompileChoice(False, "not measured",
                                 reason="a trial over several replicas runs its traced graph under 'auto'"), None
        probe = XlaProbe(cached=ChoiceCache().entry(self._xla_key()))
        return probe.choice, probe

    def _xla_key(self) -> str:
        """The cache key of ``compile: auto``'s measurement: what decides the step's seconds (the model, the
        stage's input, the precision, the device and threads) and the TensorFlow and Keras versions."""
        import keras
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        device = (str(tf.config.experimental.get_device_details(gpus[0]).get("device_name", gpus[0].name)) if gpus
                  else f"cpu {cpu_model()}")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return cache_key(kind="xla", model=self.spec.model.model_dump(mode="json"), tile=self.stage.tile,
                         batch=self.stage.batch_size, channels=(self.in_channels, self.num_classes),
                         precision=self.spec.training.precision, loss=self.spec.training.loss.model_dump(mode="json"),
                         deep_supervision=self.spec.training.deep_supervision, device=device,
                         threads=(tf.config.threading.get_intra_op_parallelism_threads(), cpus),
                         tensorflow=tf.__version__, keras=keras.__version__)

    def _take_probe_choice(self) -> None:
        """The probe's choice as the trial's, its own measurement cached once it is in."""
        probe = self._xla_probe
        assert probe is not None
        self._train_step = self._xla_step if self._on_xla() else self._graph_step
        if probe.measured and self.compile is not probe.choice:
            entry = compile_cache_entry(probe.choice)
            if entry is not None:
                ChoiceCache().put_entry(self._xla_key(), entry)
        self.compile = probe.choice

    def _trace_train_step(self) -> None:
        """The training step as a ``tf.function`` for the current input pipeline's batches: one trace for every
        batch size (the training split's last batch may be short: a worker's shard of 3 cases in batches of 2; a
        second trace of the step costs as much as the first, 3 to 5 s). A curriculum stage of another tile traces
        it again. Under ``compile: auto`` an XLA step is made beside the graph's (traced only where the trial
        tries it)."""
        import tensorflow as tf

        if isinstance(self.train_data, tf.data.Dataset):
            signature = list(self.train_data.element_spec)
            self._graph_step = tf.function(self._replica_train_step, input_signature=signature,
                                           jit_compile=self.compile.source == "set" and self.compile.compiled)
            self._xla_step = (tf.function(self._replica_train_step, input_signature=signature, jit_compile=True)
                              if self._xla_probe is not None else None)
        else:  # a distributed dataset, stepped inside train_steps
            self._graph_step = tf.function(self._replica_train_step, reduce_retracing=True)
            self._xla_step = None
        self._train_step = self._xla_step if self._on_xla() else self._graph_step

    def _on_xla(self) -> bool:
        """Whether ``compile: auto``'s probe has the steps run XLA's compiled step now."""
        return self._xla_probe is not None and self._xla_step is not None and self._xla_probe.phase == "xla"

    def _probed_step(self, x: Any, y: Any, steps_left: int) -> float:
        """One training step under ``compile: auto``'s probe: timed and told to it; an XLA compilation that fails
        leaves the graph's step, and the trial says why."""
        probe = self._xla_probe
        assert probe is not None
        started = time.perf_counter()
        try:
            loss = float(self._train_step(x, y))
        except Exception as exc:  # noqa: BLE001 - an XLA compilation that fails falls back to the graph
            if self._train_step is not self._xla_step:
                raise
            probe.fell_back(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
            logger.warning("the U-Net's XLA step does not compile; the traced graph trains it: %s", probe.choice.reason)
            self._take_probe_choice()
            return float(self._train_step(x, y))
        probe.observe(time.perf_counter() - started, steps_left)
        self._take_probe_choice()
        return loss

    def enter_stage(self, stage: TrainingStage, seed: int, *, new_order: bool = False) -> None:
        """Train on ``stage``'s input from now on (``training.curriculum``): an input pipeline of its tile, batch and
        tile sampling (its order seeded by ``seed``), and a step traced for it when its shapes differ. Nothing to
        do in the same stage, unless ``new_order`` asks for the input pipeline again."""
        if stage == self.stage and not new_order:
            return
        retrace = stage.shape != self.stage.shape
        self.stage = stage
        self.train_data = self._train_data(seed)
        if retrace:
            self._trace_train_step()

    def _build(self, keras: Any, manifest: DataManifest) -> tuple[Any, Any]:
        model = self._build_model(manifest)
        optimizer = keras_optimizer(self.spec.training.optimizer, self.layout.effective_lr)
        if self.spec.training.precision == "fp16":  # float16's narrow range: a dynamically scaled loss
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        return model, optimizer

    def _build_model(self, manifest: DataManifest) -> Any:
        """The U-Net, built through its registry entry (:func:`~distmis.networks.build_network`)."""
        network = NetworkInput(in_channels=manifest.in_channels, out_channels=self.num_classes,
                               tile=manifest.volume, activation=self.activation,
                               precision=self.spec.training.precision)
        return build_network(self.spec.model.entry, self.spec.model.params, network, "tensorflow")

    # ------------------------------------------------------------------ a new trial on the same graphs
    def restart(self, spec: Spec, layout: TrialLayout) -> None:
        """Make this trainer the fresh trainer of another trial whose graphs are the same (:func:`graph_key`): the
        weights a new trainer would start from (the same seeded draw), a zeroed optimizer at the trial's learning
        rate, the data order of its seed, the training and validation cases of its fold (cross-validation: another
        fold's trial trains and validates on its own cases, never the previous trial's). What is kept is the
        traced and optimized training and prediction graphs, which a new model would build again (5 to 10 s a
        trial for the U-Net of benchmarks/speedup.yaml).
        """
        from distmis.data.cases import SplitCases
        from distmis.data.manifest import read_manifest
        from distmis.parallel.tensorflow_cluster import broadcast_from_first_replica

        if graph_key(spec) != graph_key(self.spec):
            raise ValueError("restart needs a trial with the same model and training graphs; this one differs in "
                             "more than the learning rate, the seed and the number of epochs")
        if layout.world_size != self.layout.world_size:
            raise ValueError(f"restart needs the same number of workers ({self.layout.world_size}), "
                             f"got {layout.world_size}")
        manifest = read_manifest(self.tfrecord_dir)
        parts = trial_parts(manifest, spec.dataset.split.fold, self.tfrecord_dir)  # the new trial's fold
        if parts.val != self.parts.val:
            val_cases = SplitCases(self.tfrecord_dir, parts.val, label_dtype=np.float32, manifest=manifest)
            if not val_cases:
                raise ValueError(f"{self.tfrecord_dir}: the validation split holds no cases")
            self.val_cases = val_cases
        self.parts, self._num_train = parts, parts.num_train  # the input pipeline below reads its training parts
        self.spec, self.layout = spec, layout
        seed_everything(spec.training.seed)
        fresh = self._build_model(manifest)  # only its initial weights
        self.model.set_weights(fresh.get_weights())
        broadcast_from_first_replica(self.strategy, self.model.weights)
        for variable in self.optimizer.variables:
            variable.assign(np.zeros(variable.shape, dtype=variable.dtype))
        if hasattr(self.optimizer, "dynamic_scale"):  # fp16's loss scale starts again where a new one starts
            self.optimizer.dynamic_scale.assign(self.optimizer.initial_scale)
        self.optimizer.learning_rate = layout.effective_lr
        self.learning_rates = LearningRateSchedule.for_training(spec.training, layout.effective_lr)
        self._epochs_trained = 0
        if self._xla_probe is not None:  # compile: auto measures again for the new trial (its planned steps), on
            self.compile, self._xla_probe = self._compile_choice()  # the steps already traced
            self._train_step = self._graph_step
        # the new trial's data order, in its first stage (the kept trainer may have ended in another)
        self.enter_stage(stage_at(spec.training, 1), seed=spec.training.seed, new_order=True)

    def _train_data(self, seed: int) -> Any:
        """One process: the training split once per epoch. Several workers: each reads its shard (every
        ``replicas``-th case, from its own task index) once per epoch, in batches whose last one may be short, as
        one process does with the whole split; the passes repeat without end, and every worker takes the same
        number of steps an epoch (collectives would hang otherwise: the largest shard's batches) from one iterator
        that lives as long as the dataset (see :meth:`train_epoch`).

        The shard is a plain ``tf.data`` pipeline of this worker, fed to its replica by ``strategy.run``, rather
        than ``distribute_datasets_from_function``'s multi-device iterator: with one device a worker that adds
        nothing but a buffer thread, and dropping one (a new trial on a kept trainer: :meth:`restart`) blocked its
        worker for 1 to 14 s on 2 cores (tf.data's autotuning thread, since turned off). The cases and their order
        are the same (the same shard of the same seeded pipeline)."""
        from distmis.data.tfrecord import make_dataset

        training, stage = self.spec.training, self.stage
        # popped, so that the thread holds the iterator's last reference (absent on the first call, from __init__)
        _release_in_background(self.__dict__.pop("_train_iterator", None))
        self._train_iterator = None
        # training.steps_per_epoch, or one pass over the cases (the largest shard's, with several workers)
        self.steps_per_epoch = training.epoch_steps(self._num_train, stage.batch_size, self.replicas)
        if self.replicas == 1:
            dataset = make_dataset(self.tfrecord_dir, self.parts.train, batch_size=stage.batch_size, shuffle=True,
                                   seed=seed, tile=stage.tile, tile_sampling=stage.tile_sampling,
                                   augment=training.augment)
            # a fixed number of steps: the passes repeat without end, and each epoch goes on where the last stopped
            return dataset if training.steps_per_epoch is None else dataset.repeat()

        def worker_dataset(pipelines: int, index: int) -> Any:
            return make_dataset(
                self.tfrecord_dir, self.parts.train, batch_size=stage.batch_size, shuffle=True, seed=seed,
                tile=stage.tile, tile_sampling=stage.tile_sampling, augment=training.augment,
                shard=(pipelines, index),
            ).repeat()  # each pass reshuffled and re-tiled

        worker = _worker_of(self.strategy)
        if worker is not None and worker[0] == self.replicas:  # one replica per worker
            return worker_dataset(*worker)
        return self.strategy.distribute_datasets_from_function(
            lambda context: worker_dataset(context.num_input_pipelines, context.input_pipeline_id))

    # ------------------------------------------------------------------ training
    def train_epoch(self, epoch: int | None = None) -> float:
        """One pass over the training split (or ``training.steps_per_epoch`` batches); the mean batch loss. The learning rate is ``training.lr_schedule``'s
        for epoch ``epoch`` (counted from 1; by default the one after those this trainer has trained).

        Several replicas take the same number of steps an epoch from an iterator made once (a new distributed
        iterator per epoch, with its cross-worker check for the end of the data at every ``next``, kept two
        workers on CPU waiting on each other for seconds to a minute at epoch starts: benchmarks/history.md). A
        worker's own pipeline is stepped from Python, one call of the traced step per batch; a distributed
        dataset (several replicas in one worker) runs the epoch's steps in one ``tf.function`` loop, its ``next``
        in the graph. Four 3-epoch trials on a kept 2-worker group took 62 to 67 s stepped from Python against
        72.5 s in the loop, whose first epochs were longer (benchmarks/history.md).
        """
        import tensorflow as tf

        epoch = self._epochs_trained + 1 if epoch is None else epoch
        self._epochs_trained = epoch
        stage = stage_at(self.spec.training, epoch)
        self.enter_stage(stage, seed=self.spec.training.seed + stage.first_epoch)
        steps = self.steps_per_epoch
        rates = [self.learning_rates.at(epoch, step, steps) for step in range(steps)]
        self.step_share = None  # measured where the steps are called from Python, one at a time
        if self.replicas > 1 and not isinstance(self.train_data, tf.data.Dataset):  # a distributed dataset
            if self._train_iterator is None:
                self._train_iterator = iter(self.train_data)
            return float(self._train_steps(self._train_iterator, tf.constant(rates, tf.float32)))
        if self.replicas > 1 or self.spec.training.steps_per_epoch is not None:
            # this worker's own pipeline, repeated: the same number of steps on every worker (or the fixed number)
            if self._train_iterator is None:
                self._train_iterator = iter(self.train_data)
            batches: Any = (next(self._train_iterator) for _ in range(steps))
        else:
            batches = iter(self.train_data)
        losses = []
        started, in_steps = time.perf_counter(), 0.0
        probe = self._xla_probe if self._xla_probe is not None and not self._xla_probe.done else None
        later = steps * max(self.spec.training.epochs - epoch, 0)  # the planned steps after this epoch's
        for step, (x, y) in enumerate(batches):  # the input pipeline's wait is the time between the steps
            stepping = time.perf_counter()
            if step == 0 or self.learning_rates.per_step:
                self.optimizer.learning_rate = rates[min(step, steps - 1)]
            if probe is None:
                losses.append(float(self._train_step(x, y)))
            else:
                losses.append(self._probed_step(x, y, steps_left=later + max(steps - step - 1, 0)))
            in_steps += time.perf_counter() - stepping
        self.step_share = in_steps / max(time.perf_counter() - started, 1e-9)
        if probe is not None:
            probe.end_epoch(later)
            self._take_probe_choice()
        if not losses:
            raise ValueError(f"{self.tfrecord_dir}: the training split holds no cases")
        return float(np.mean(losses))

    # ------------------------------------------------------------------ validation
    def predict_volume(self, image: np.ndarray, *, mirror: Sequence[int] = ()) -> np.ndarray:
        """Probabilities for one (H, W, D, C) volume: whole, or by sliding windows of the (last curriculum
        stage's) tile (``training.inference``: overlap, constant or Gaussian weights); each window test-time
        mirrored on the axes ``mirror`` of the volume (default none: validation; the test split:
        ``training.inference.mirror``)."""
        return self.predict_with_window(image, self.window, mirror=mirror)

    def predict_with_window(self, image: np.ndarray, window: tuple[int, int, int] | None, *,
                            mirror: Sequence[int] = ()) -> np.ndarray:
        """:meth:`predict_volume` by sliding windows of ``window`` (None: the whole volume in one pass), each
        mirrored on the axes ``mirror`` (:func:`distmis.pyfunc_model.mirrored`)."""
        training = self.spec.training
        return predict_channels_last(lambda batch: self._predict(batch).numpy(), image, window,
                                     inference=training.inference, batch_size=training.inference_batch_size,
                                     mirror=mirror)

    @contextlib.contextmanager
    def weights_from(self, directory: str | Path) -> Iterator[None]:
        """The weights :meth:`save` wrote to ``directory`` in the model for the block, the current ones after."""
        current = self.model.get_weights()
        self.load(directory)
        try:
            yield
        finally:
            self.model.set_weights(current)

    def case_dice(self, prob: np.ndarray, label: np.ndarray) -> np.ndarray:
        """Dice of one case's prediction ``prob`` against its target channels ``label`` (both ``(h, w, d, C)``), for
        each foreground channel of the target scheme (:func:`~distmis.train.metrics.class_dice`: thresholded
        sigmoid channels, or the softmax's argmax), in the order of :attr:`metric_keys`."""
        from distmis.train.metrics import class_dice

        return class_dice(prob, label, self.targets)

    def validate(self) -> ValidationScores:
        """Mean validation loss, mean per-case dice (each case's mean over the foreground channels) and each
        foreground channel's mean dice, over the validation split (every worker validates all of it)."""
        losses, dices, per_class = [], [], []
        for _case_id, image, label in self.val_cases:
            prob = self.predict_volume(image)
            losses.append(float(self.loss_fn(label[None], prob[None])))
            dice = self.case_dice(prob, label)
            dices.append(float(dice.mean()))
            per_class.append(dice)
        class_means = np.mean(per_class, axis=0)
        return ValidationScores(float(np.mean(losses)), float(np.mean(dices)),
                                {key: float(value) for key, value in zip(self.metric_keys, class_means)})

    def run_epoch(self, epoch: int) -> EpochMetrics:
        """Train one epoch, validate, and time both; with the training steps' peak memory and its prediction where a
        worker trains one replica (:meth:`memory_metrics`). Raises NonFiniteLossError if training diverged."""
        peak: list[float | None] = []

        def train() -> float:
            meter = AllocatorMeter(allocator_device()) if self.one_replica_here else None
            if meter is not None:  # Adam's moments, once made, are the step's as in the first epoch
                meter.start(held=float(sum(_variable_bytes(v) for v in self.optimizer.variables)))
            loss = self.train_epoch(epoch)
            peak.append(meter.stop() if meter is not None else None)
            return loss

        metrics = checked_epoch(epoch, train, self.validate, learning_rate=self.learning_rates.at(epoch))
        share = {} if self.step_share is None else {"step_share": self.step_share}
        return dataclasses.replace(metrics, **curriculum_metrics(self.spec.training, epoch, self.volume_shape),
                                   **self.memory_metrics(peak[0] if peak else None), **share,
                                   **self.compile.metrics())

    @property
    def one_replica_here(self) -> bool:
        """Whether this process trains one replica: a single-replica strategy, or one worker of a multi-worker one
        with a replica per worker (a data-parallel trial on CPUs or one GPU each). Its allocator then holds that
        replica's step alone, as the prediction does (plus the all-reduce's buffers)."""
        if self.replicas == 1:
            return True
        worker = _worker_of(self.strategy)
        return worker is not None and worker[0] == self.replicas

    def memory_metrics(self, peak: float | None) -> dict[str, float]:
        """``peak_memory_mb`` (the allocator's, :class:`~distmis.train.tf_metering.AllocatorMeter`) and the traced
        step's prediction at the current stage's input (:func:`distmis.estimate.keras_step.trace_keras_step`, of this
        model's step, traced once per input and never run): ``predicted_step_memory_mb`` (what ``peak_memory_mb``
        measures), ``predicted_peak_memory_mb`` (with the weights and the batch) and ``predicted_flops_per_step``.
        Only a process that trains one replica reports them (:attr:`one_replica_here`); a prediction that cannot be
        made is a warning."""
        if peak is None:
            return {}
        metrics = {"peak_memory_mb": peak / 2**20}
        tile = tuple(self.stage.tile or self.volume_shape)
        key = (tile, self.stage.batch_size)
        if key not in self._predictions:
            from distmis.estimate.keras_step import trace_keras_step

            network = NetworkInput(int(self.model.input_shape[-1]), self.num_classes, tile,  # type: ignore[arg-type]
                                   activation=self.activation, precision=self.spec.training.precision)
            try:
                # a multi-worker replica's variables are mirrored, which a step traced outside the strategy cannot
                # update: a copy of the network of its own is traced then
                trace = trace_keras_step(self.spec.model.entry, self.spec.model.params, network, self.loss_fn,
                                         batch=self.stage.batch_size, precision=self.spec.training.precision,
                                         model=self.model if self.replicas == 1 else None)
            except Exception as exc:  # noqa: BLE001 - a prediction that cannot be made never stops training
                logger.warning("no memory prediction for the Keras U-Net at %s, batch %d: %s: %s", list(tile),
                               self.stage.batch_size, type(exc).__name__, exc)
                self._predictions[key] = {}
            else:  # the allocator's count: tensors alone, no C heap to add
                step = trace.optimizer_bytes + trace.peak_bytes
                self._predictions[key] = {
                    "predicted_step_memory_mb": step / 2**20,
                    "predicted_peak_memory_mb": (step + trace.parameter_bytes + trace.batch_bytes) / 2**20,
                    "predicted_flops_per_step": trace.flops}
        return {**metrics, **self._predictions[key]}

    weight_files: tuple[str, ...] = ("model.weights.h5",)

    def save(self, directory: str | Path) -> Path:
        """Save the weights (Keras ``.weights.h5``) into ``directory``."""
        path = Path(directory) / "model.weights.h5"
        self.model.save_weights(path)
        return path

    def load(self, directory: str | Path) -> None:
        """Load weights saved by :meth:`save`."""
        self.model.load_weights(Path(directory) / "model.weights.h5")

    # ------------------------------------------------------------------ resuming (see distmis.train.checkpoint)
    def save_state(self, directory: str | Path, *, rank: int = 0, primary: bool = True) -> None:
        """The weights and the optimizer's variables (its step count, Adam's moments or SGD's momentum), from the
        ``primary`` rank."""
        if not primary:
            return
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_weights(directory / "model.weights.h5")
        np.savez(directory / "optimizer.npz", *[np.asarray(v.numpy()) for v in self.optimizer.variables])

    def load_state(self, directory: str | Path, *, rank: int = 0, epoch: int) -> None:
        """Continue after ``epoch`` epochs from :meth:`save_state`'s folder: weights and optimizer state exactly.

        The ``tf.data`` pipeline's shuffle and tile streams cannot be saved mid-way: after a resume they are
        seeded from the seed and ``epoch``, a fresh order rather than the one an uninterrupted run would have
        drawn (the torch trainers continue exactly).
        """
        directory = Path(directory)
        self.model.load_weights(directory / "model.weights.h5")
        with self.strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(self.model.trainable_variables)
        saved = np.load(directory / "optimizer.npz")
        values = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        if len(values) != len(self.optimizer.variables):
            raise ValueError(f"{directory}: the optimizer state holds {len(values)} variables, this trial's optimizer "
                             f"has {len(self.optimizer.variables)}: the checkpoint is from another model")
        for variable, value in zip(self.optimizer.variables, values):
            variable.assign(value)
        seed = self.spec.training.seed + epoch
        seed_everything(seed)
        self.train_data = self._train_data(seed)
        self._epochs_trained = epoch
