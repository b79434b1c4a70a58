"""Host access: every file under ``--root`` is opened here (:mod:`gpu_tune.host.fs`), and the
kernel's formats are parsed by pure functions (:mod:`gpu_tune.host.parse`)."""
