"""`python -m services.router`: the HTTP front door (settings from the environment)."""

from shared.config import ENV_PREFIX, RouterSettings
from shared.security.credentials import require_credentials
from shared.serving.runtime import setup_logging

from .main import serve


def main() -> None:
    setup_logging("router")
    settings = require_credentials(RouterSettings(), "router", ENV_PREFIX["router"], kv=False)
    serve(settings)


if __name__ == "__main__":
    main()
