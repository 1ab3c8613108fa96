"""`python -m tunegrid.cli <command>`: how the supervisor starts a worker."""

from tunegrid.cli.main import run

if __name__ == "__main__":  # a spawned child re-imports this module as __mp_main__: it must not re-run
    run()
