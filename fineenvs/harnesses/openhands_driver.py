"""Run one OpenHands SDK agent headless. Executed by the openhands venv's own Python (>= 3.12).

``python openhands_driver.py CONFIG.json WORKDIR TASK`` where CONFIG holds ``base_url``,
``api_key``, ``model`` and ``max_iterations``; the conversation store and the event log go next to
it (the attempt's HOME). The key sits in the file, not in argv. Stdlib plus the SDK only: this file must not
import fineenvs (it runs outside the project's venv).
"""

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    config = Path(argv[0])
    cfg = json.loads(config.read_text())
    workdir, task = argv[1], argv[2]
    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.sdk.conversation.response_utils import get_agent_final_response
    from openhands.tools.file_editor import FileEditorTool
    from openhands.tools.terminal import TerminalTool

    llm = LLM(
        model=cfg["model"],
        base_url=cfg["base_url"],
        api_key=cfg["api_key"],
        usage_id="agent",
        native_tool_calling=True,
        num_retries=1,
    )
    agent = Agent(llm=llm, tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)])
    conversation = Conversation(
        agent=agent,
        workspace=workdir,
        persistence_dir=str(config.parent / ".openhands" / "conversations"),
        max_iteration_per_run=int(cfg["max_iterations"]),
        visualizer=None,
        delete_on_close=False,
    )
    conversation.send_message(task)
    try:
        conversation.run()
    finally:
        events = list(conversation.state.events)
        rows = []
        for ev in events:
            rows.append(
                {
                    "kind": type(ev).__name__,
                    "source": getattr(ev, "source", None),
                    "tool_name": getattr(ev, "tool_name", None),
                }
            )
        final = get_agent_final_response(events)
        (config.parent / "openhands_events.json").write_text(
            json.dumps({"events": rows, "final_response": final}, indent=1)
        )
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
