"""ActiveKV's intake screen: keep the Python boundary minimal by rejecting, before merge, new Python modules, Python
imports from C++, per-step Python callbacks, Python headers in the engine and uncited Python lines in the vLLM patch.

Usage::

    python -m intake check --base REV [--repo DIR] [--staged]   # what changed since REV (work tree + untracked)
    python -m intake scan PATH... [--root DIR]                    # the given files and folders, whole, no git
    common options: --format text|json|sarif, --compile-commands FILE, --baseline FILE, --vllm-src DIR,
                    --cache DIR | --no-cache, --jobs N

Exit status: 0 clean, 1 findings, 2 the screen could not run (the reason is printed on stderr).

Rules (stable ids; ``findings.RULES`` has their texts): ``new-python-module``, ``python-import-from-cpp``,
``per-step-python-callback``, ``request-path-python-call``, ``python-in-engine``, ``uncited-python-line``,
``parse-error`` (a C/C++ file libclang cannot parse is a finding, never a pass), ``unreadable-file`` (a FIFO, device,
socket, folder link, a link out of the tree or a file over 8 MiB: never read, never passed; ``files``),
``baseline-change``, ``baseline-stale``.

Modules: ``screen`` (scan, check), ``native`` (C/C++ program and rules) on ``cxx`` (libclang facts) and ``prelude``
(the precompiled third-party headers units share), ``flags``
(compile_commands.json), ``cache`` (parse cache), ``pyfiles``, ``patches`` (on ``tools.contracts``), ``baseline``,
``gitdiff`` (gitpython), ``files`` (the one way files are walked and read), ``findings`` (rules and output formats),
``bench`` (cold and warm scan times).
"""
