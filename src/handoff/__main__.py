"""`python -m handoff ...` (also the entry point under torchrun)."""

from handoff.cli import app

if __name__ == "__main__":
    app()
