"""Running a search: prepare the data, plan the trials, run them with Ray Tune (and Ray Train), record them.

``run.run_search`` is the whole job behind ``distmis run``; ``compare.run_compare`` the experiment- vs
data-parallel comparison; ``execute.execute_search`` one search on a connected Ray; ``plan`` how the trials
share the cluster; ``trainable`` what runs for one trial and in each Ray Train worker.
"""
