package anthropic

import (
	"testing"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// BenchmarkStreamEvent reads the event a streamed Message carries most
// (a text delta) next to what chat's relay reads for its most common
// event (a content chunk), so the per-event cost of the two protocols
// compares in one run.
func BenchmarkStreamEvent(b *testing.B) {
	delta := []byte("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok7 \"}}\n\n")
	chunk := []byte(`data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"tok7 "},"finish_reason":null}]}` + "\n\n")
	b.Run("messages_text_delta", func(b *testing.B) {
		var s Stream
		b.ReportAllocs()
		for b.Loop() {
			if !s.Event(delta).Text {
				b.Fatal("no text")
			}
		}
	})
	b.Run("chat_content_chunk", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if !openai.ParseEvent(chunk).Text {
				b.Fatal("no text")
			}
		}
	})
}
