"""What runs in a trial's processes: the Ray Tune trainables and Ray Train worker loops (``trainables``), the trainer
factory (``trainers``), a data-mode search's worker group (``worker_group``) and the trainers a process keeps
between trials (``kept_trainers``), a trial's checkpoint folders (``checkpoints``), Ray Train's placement groups
(``placement_groups``), the storage Tune and Ray Train write through (``storage``), and what a trial leaves for the
driver to read (``record``).

The driver (:mod:`distmis.search`) imports ``trainables``, ``trainers``, ``checkpoints``, ``storage`` and
``record`` only (``tests/test_architecture.py`` checks it). Nothing is imported here: importing the package is free.
"""
