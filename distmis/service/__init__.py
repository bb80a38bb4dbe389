"""The head-node service: a Ray head started and stopped on this machine (``cluster``), searches submitted to
a cluster through the Ray Jobs API (``jobs``), the MLflow UI over a search's store (``server``), and the
loopback and port helpers they share (``net``), and child processes that die with their parent (``lifetime``,
and ``guard``, which takes a server's whole process group down with it)."""
