package openai

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"testing/iotest"
)

// relayAll relays src as the proxy does: every event the reader returns,
// except the usage-only chunk unless includeUsage.
func relayAll(t testing.TB, src io.Reader, includeUsage bool) (out []byte, events []Event) {
	er := NewEventReader(src)
	for {
		ev, err := er.Next()
		if ev != nil {
			pe := ParseEvent(ev)
			events = append(events, pe)
			if pe.Keep(includeUsage) {
				out = append(out, ev...)
			}
		}
		if errors.Is(err, io.EOF) {
			return out, events
		}
		if err != nil {
			t.Fatalf("read: %v", err)
		}
	}
}

// FuzzSSERelay: the relay is byte for byte. With include_usage every event
// is kept and the output is the input (long lines, CRLF, a missing final
// blank line included); without it only usage-only chunks are dropped, and
// no input makes ParseEvent panic.
func FuzzSSERelay(f *testing.F) {
	for _, s := range []string{
		"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
		"data: {\"error\":{\"message\":\"boom\"}}\n\n",
		": comment\r\n\r\ndata: a\r\ndata: b\r\n\r\n",
		"data: {\"choices\":[{\"text\":\"x\"}]}",
		"\n\n\n",
		"data: " + string(bytes.Repeat([]byte("x"), 40<<10)) + "\n\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		out, events := relayAll(t, bytes.NewReader(in), true)
		if !bytes.Equal(out, in) {
			t.Fatalf("relay changed the stream:\n in %q\nout %q", in, out)
		}
		// One byte at a time: the same events.
		out1, events1 := relayAll(t, iotest.OneByteReader(bytes.NewReader(in)), true)
		if !bytes.Equal(out1, in) || len(events1) != len(events) {
			t.Fatalf("byte-at-a-time reads split the stream differently")
		}
		stripped, _ := relayAll(t, bytes.NewReader(in), false)
		dropped := 0
		for _, e := range events {
			if e.UsageOnly {
				dropped++
			}
		}
		if dropped == 0 && !bytes.Equal(stripped, in) {
			t.Fatalf("events dropped without a usage-only chunk")
		}
		if len(stripped) > len(in) {
			t.Fatalf("relay grew the stream")
		}
	})
}

func TestParseEvent(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ev   string
		want Event
	}{
		{"data: [DONE]\n\n", Event{Done: true}},
		{": keepalive\n\n", Event{NoData: true}},
		{"data: {\"error\":{}}\n\n", Event{Error: true}},
		{"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n", Event{Text: true}},
		{"data: {\"choices\":[{\"delta\":{\"content\":\"\"}}]}\n\n", Event{}},
	} {
		got := ParseEvent([]byte(tc.ev))
		if got != tc.want {
			t.Errorf("%q: got %+v, want %+v", tc.ev, got, tc.want)
		}
	}
	e := ParseEvent([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":1}}}\n\n"))
	if !e.UsageOnly || e.Usage == nil || e.Usage.PromptTokens != 3 || e.Usage.CompletionTokens != 2 || e.Usage.CachedTokens() != 1 || e.Keep(false) || !e.Keep(true) {
		t.Fatalf("usage chunk: %+v", e)
	}
}
