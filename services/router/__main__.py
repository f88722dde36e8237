"""`python -m services.router`: the HTTP front door (settings from the environment)."""

import uvicorn

from shared.config import ENV_PREFIX, RouterSettings
from shared.security.credentials import require_credentials
from shared.serving.runtime import setup_logging

from .main import build_app


def main() -> None:
    setup_logging("router")
    settings = require_credentials(RouterSettings(), "router", ENV_PREFIX["router"], kv=False)
    uvicorn.run(build_app(settings), host=settings.host, port=settings.port, log_level="warning")


if __name__ == "__main__":
    main()
