"""`python -m services.main_decode`: settings from the environment (see shared/config.py)."""

import asyncio

from shared.config import MainDecodeSettings
from shared.serving.runtime import serve_service, setup_logging

from .service import MainDecodeService


def main() -> None:
    setup_logging("main_decode")
    asyncio.run(serve_service("main_decode", MainDecodeSettings(), MainDecodeService))


if __name__ == "__main__":
    main()
