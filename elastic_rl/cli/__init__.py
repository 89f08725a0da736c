"""`erl`, the command line users drive elastic-rl with.

Every subcommand's help ends with an example. The CLI imports no torch, so it
answers in well under a second. Every command reaches etcd at ``--etcd URL``
(default: ``$ERL_ETCD``, else the embedded etcd's address). Exit codes: 0
success, 1 a job or command that failed, 2 bad input (an invalid spec, a
missing file), with every problem printed.

Where each part lives:

- ``main``: the parser, assembled from the groups below in `erl --help`'s order, and ``main()``
  (the ``erl`` entry point; ``python -m elastic_rl.cli`` runs it through ``__main__``).
- ``common``: the exit codes, the etcd client options and their endpoint, the subcommand helpers.
- ``jobs_submit``: validate, run, submit (and following a job `erl run` submitted).
- ``jobs_read``: status, list, logs.
- ``plot``: plot.
- ``jobs_control``: stop, scale, resume.
- ``chaos``: chaos run.
- ``model``: model import.
- ``cluster``: nodes, devices reset.
- ``erld``: daemon, shutdown, and the background erld `erl run` starts.
"""
