"""Performance arithmetic: the 3D ViT's FLOP, memory and communication model (:mod:`~distmis.perf.model`), how
sequence parallelism partitions its tokens (:mod:`~distmis.perf.partition`) and the sequence-parallel degree a
memory budget allows (:mod:`~distmis.perf.sizing`).

Pure arithmetic on plain numbers: nothing here imports torch, Ray, TensorFlow or the rest of distmis. The spec's
checks, the planner, the trainers and the MLflow callback all call it with their own values.
"""
