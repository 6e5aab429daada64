"""``python -m torchstrategy.server``: run one worker or ps task of a parameter-server
cluster (see `torchstrategy.parameter_server.server`)."""
from torchstrategy.parameter_server.server import Server, main

__all__ = ["Server", "main"]

if __name__ == "__main__":
    main()
