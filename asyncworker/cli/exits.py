"""The command line's exit codes, in one place: the numbers the commands
return and the text every ``--help`` ends with (the package's docstring and the
README say the same)."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DEAD = 0, 1, 2, 3
EXIT_INTERRUPTED = 130

EXIT_CODES = """\
exit codes:
  0    done (run: and no job went dead in this run)
  1    the work failed: a conflict, a refused redrive or cancel, no such job,
       no such endpoint, an endpoint's name taken or its removal refused,
       no answer from the receiver, a database or file error (read-only,
       locked, a server it cannot reach or log in to); also, quietly, when
       standard output is closed early (| head)
  2    bad usage, or a missing, foreign, damaged or newer-version file or folder,
       or a database without a queue (serve: also an inbox it cannot open or a
       port it cannot bind; run: a --metrics port it cannot bind)
  3    run: some jobs went dead in this run (the summary counts them by reason);
       also run --until-idle ending idle with ordering keys blocked behind a
       dead job (the summary names each key and its dead head)
  130  interrupted (run and serve stop gracefully on SIGINT/SIGTERM instead;
       run aborted by a second signal: the summary names the leases left)"""
