"""`python -m services.prefill`: settings from the environment (see shared/config.py)."""

import asyncio

from shared.config import PrefillSettings
from shared.serving.runtime import serve_service, setup_logging

from .service import PrefillService


def main() -> None:
    setup_logging("prefill")
    asyncio.run(serve_service("prefill", PrefillSettings(), PrefillService))


if __name__ == "__main__":
    main()
