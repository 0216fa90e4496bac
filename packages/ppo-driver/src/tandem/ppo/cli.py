"""Console script `ppo-driver`."""


def main() -> None:
    raise SystemExit("ppo-driver: not built yet")
