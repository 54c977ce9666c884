"""mta_cli.commands"""
