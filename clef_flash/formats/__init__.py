"""Asset formats every model writes with: ``aimodel`` (Core AI: save, check, run, describe) and
``mlirb`` (its weight file, written streamed and read back), and ``runtime_compile`` (the
runtime's load, its compile in a child: a full disk an error, not a SIGBUS). Which head format a recipe names is
``head.backends``' choice; the decoder and the tower are Core AI assets."""
