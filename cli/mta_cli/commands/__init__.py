"""The subcommands, one module each: parse the options, call the library, render its result.

``mta_cli.main`` registers them (imported when the app is built, so each module's own imports
stay inside its command function and ``mta --help`` stays fast).
"""
