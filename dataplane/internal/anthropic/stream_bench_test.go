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

// BenchmarkExchange reads a non-streamed exchange (the request body, then
// the answer's usage) in each protocol: the benchmark's lighthouse prompt
// and its 38-token answer.
func BenchmarkExchange(b *testing.B) {
	chatReq := []byte(`{"model":"bench","messages":[{"role":"system","content":"You are a helpful assistant."},` +
		`{"role":"user","content":"Summarise the plot of a short novel about a lighthouse keeper in two sentences."}],"max_tokens":128,"temperature":0.7}`)
	msgReq := []byte(`{"model":"bench","system":"You are a helpful assistant.","messages":[` +
		`{"role":"user","content":"Summarise the plot of a short novel about a lighthouse keeper in two sentences."}],"max_tokens":128,"temperature":0.7}`)
	chatAns := []byte(`{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench-upstream",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"A lighthouse keeper guards a remote coast."},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":42,"completion_tokens":38,"total_tokens":80}}`)
	msgAns := []byte(`{"id":"msg_bench","type":"message","role":"assistant","model":"bench-upstream",` +
		`"content":[{"type":"text","text":"A lighthouse keeper guards a remote coast."}],"stop_reason":"end_turn","stop_sequence":null,` +
		`"usage":{"input_tokens":42,"output_tokens":38}}`)
	b.Run("messages", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, e := ParseMessages(msgReq); e != nil {
				b.Fatal(e)
			}
			if BodyUsage(msgAns) == nil {
				b.Fatal("no usage")
			}
		}
	})
	b.Run("chat", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, e := openai.ParseRequest(chatReq); e != nil {
				b.Fatal(e)
			}
			if openai.BodyUsage(chatAns) == nil {
				b.Fatal("no usage")
			}
		}
	})
}
