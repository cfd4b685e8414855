"""LangChain chat model backed by the local minisgl daemon.

>>> from langchain_minisgl import ChatMiniSGL
>>> llm = ChatMiniSGL(model="smollm2", temperature=0, max_tokens=64)  # finds or starts the daemon
>>> llm.invoke("Hello").content
>>> llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?").tool_calls
>>> llm.with_structured_output(Joke).invoke("Tell me a joke about cats")
>>> MiniSGLEmbeddings(model="smollm2").embed_documents(["a text", "another"])  # last-token pooled, normalised

Install with `pip install minisgl[langchain]`.
"""

from langchain_minisgl.chat_models import ChatMiniSGL
from langchain_minisgl.embeddings import MiniSGLEmbeddings

__all__ = ["ChatMiniSGL", "MiniSGLEmbeddings"]
