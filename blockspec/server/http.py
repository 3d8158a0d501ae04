"""uvicorn's HTTP/1.1 protocol with a deadline on each request's head: a client that opens a
connection and sends its headers slowly, or not at all, cannot hold the connection (uvicorn times
only idle keep-alive connections, and any byte received stops that timer)."""

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 30.0  # a request line and headers not all arrived by then: 408, connection closed


def timeout_response(message: str) -> bytes:
    """A raw 408 with OpenAI's error JSON (h11 sends a response only to a request it has read)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return (head + body).encode()


class HeadTimeoutProtocol(H11Protocol):
    """The deadline runs from the connection's start and from the end of each response, and stops
    once the next request's head is read (its body has `RequestGate`'s own deadline)."""

    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_deadline: asyncio.TimerHandle | None = None
        self.arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.awaiting_head():
            self.arm_head_deadline()
        else:
            self.disarm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.awaiting_head():
            self.arm_head_deadline()

    def awaiting_head(self) -> bool:
        """No request is being served: between cycles, or a request answered before its body was
        read (the deadline then covers the rest of that body and the next head)."""
        return self.conn.their_state is h11.IDLE or self.conn.our_state is h11.DONE

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm_head_deadline()
        super().connection_lost(exc)

    def arm_head_deadline(self) -> None:
        """Start the deadline, unless it runs already (a head arriving in parts keeps its first)."""
        if self.head_deadline is None:
            self.head_deadline = self.loop.call_later(self.head_timeout_s, self.head_timed_out)

    def disarm_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def head_timed_out(self) -> None:
        self.head_deadline = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head arrived
            message = f"the request line and headers did not arrive within {self.head_timeout_s:g} s"
            self.transport.write(timeout_response(message))
        self.transport.close()
