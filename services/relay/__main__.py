"""`python -m services.relay`: settings from the environment (see shared/config.py)."""

import asyncio

from shared.config import RelaySettings
from shared.serving.runtime import serve_service, setup_logging

from .service import RelayService


def main() -> None:
    setup_logging("relay")
    asyncio.run(serve_service("relay", RelaySettings(), RelayService))


if __name__ == "__main__":
    main()
