"""The ``hf-tidar`` subcommands, one module each.

Every module exposes ``add_arguments(parser)`` (its flags) and ``run(args) -> int`` (the exit code, from
:mod:`hf_tidar.exit_codes`); :data:`hf_tidar.cli.COMMANDS` registers them. Heavy imports (torch's models,
datasets) stay inside ``run`` so that building the parser, and ``hf-tidar --help``, stays quick.
"""
