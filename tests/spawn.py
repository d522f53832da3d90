"""`run_world` lives in tests/conftest.py with the other shared helpers; this name is kept for the test files that
import it from here."""

from conftest import run_world

__all__ = ["run_world"]
