"""Pipeline-parallel KV memory planner (placeholder for the CLI wiring)."""
from __future__ import annotations

import argparse


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    pass


def main_plan(args: argparse.Namespace) -> int:
    return 0
