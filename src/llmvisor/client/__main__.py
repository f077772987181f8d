"""``python -m llmvisor.client [--ack-fd N]``: the delivery process (`llmvisor.client.delivery.deliver`), as the
relay starts it."""

import sys

from llmvisor.client.delivery import main

sys.exit(main(sys.argv[1:]))
