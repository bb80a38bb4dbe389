"""The driver of a search: prepare the data, plan the trials, run them with Ray Tune (and Ray Train), record them.

``run.run_search`` is the whole job behind ``distmis run``; ``compare.run_compare`` the experiment- vs
data-parallel comparison; ``tune_run.execute_search`` one search's trials on a connected Ray, ``finish.end_search``
its end; ``plan`` how the trials share the cluster. What runs for one trial, and in each Ray Train worker, is the
trial package's (:mod:`distmis.trial`).
"""
