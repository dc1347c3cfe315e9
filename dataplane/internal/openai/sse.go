package openai

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
)

// Server-sent events of a streamed answer, as engines send them: events of
// "data:" lines ending at a blank line, a final "data: [DONE]", usage in a
// chunk without choices (requested upstream with include_usage), and an
// error object as an event's data when the engine fails mid-stream.

var (
	dataPrefix  = []byte("data:")
	doneMarker  = []byte("[DONE]")
	usageKey    = []byte(`"usage"`)
	errorPrefix = []byte(`{"error"`)
)

// EventReader splits an SSE body into events, byte for byte: the events
// it returns, concatenated, are the body (lines longer than its buffer
// included), so a relay that writes every event it keeps changes nothing
// else.
type EventReader struct {
	br      *bufio.Reader
	ev      []byte
	partial bool
}

// NewEventReader reads events from r.
func NewEventReader(r io.Reader) *EventReader {
	return &EventReader{br: bufio.NewReaderSize(r, 16<<10)}
}

// Next returns the next event (its lines and the blank line ending it),
// valid until the next call, and the read error once the body ends (io.EOF
// at its end). An event and an error may come together: the body's last
// event when it does not end with a blank line.
func (er *EventReader) Next() (ev []byte, err error) {
	er.ev = er.ev[:0]
	for {
		line, err := er.br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			er.ev = append(er.ev, line...)
			er.partial = true
			continue
		}
		er.ev = append(er.ev, line...)
		blank := !er.partial && len(line) > 0 && (line[0] == '\n' || line[0] == '\r')
		er.partial = false
		// An event ends at a blank line (or at the end of the body).
		if blank || (err != nil && len(er.ev) > 0) {
			return er.ev, err
		}
		if err != nil {
			return nil, err
		}
	}
}

// Event is what the proxy reads of one SSE event.
type Event struct {
	// NoData: the event has no data line (a comment, a blank line).
	NoData bool
	// Done: the data is the [DONE] marker.
	Done bool
	// Error: the data is an error object (the engine failed mid-stream).
	Error bool
	// Usage is the usage the chunk carries, if any; UsageOnly says the
	// chunk has no choices (the usage chunk requested upstream).
	Usage     *Usage
	UsageOnly bool
	// Text: the chunk carries generated text (chat delta content or
	// completion text).
	Text bool
}

// ParseEvent reads one event (as EventReader returns it).
func ParseEvent(ev []byte) Event {
	payload := ssePayload(ev)
	if payload == nil {
		return Event{NoData: true}
	}
	if bytes.Equal(payload, doneMarker) {
		return Event{Done: true}
	}
	if bytes.HasPrefix(payload, errorPrefix) {
		return Event{Error: true}
	}
	var out Event
	if i := bytes.Index(payload, usageKey); i >= 0 {
		j := skipWS(payload, i+len(usageKey))
		if j < len(payload) && payload[j] == ':' {
			j = skipWS(payload, j+1)
		}
		if j < len(payload) && payload[j] == '{' {
			var chunk struct {
				Choices []json.RawMessage `json:"choices"`
				Usage   *Usage            `json:"usage"`
			}
			if json.Unmarshal(payload, &chunk) == nil && chunk.Usage != nil {
				out.Usage = chunk.Usage
				if len(chunk.Choices) == 0 {
					out.UsageOnly = true
					return out
				}
			}
		}
	}
	out.Text = hasText(payload)
	return out
}

// Keep says whether a relay forwards an event to a client: all but the
// usage-only chunk, which only clients that asked for it
// (stream_options.include_usage) get.
func (e Event) Keep(includeUsage bool) bool { return !e.UsageOnly || includeUsage }

// ErrorEvent is e as an SSE event (sent once the headers are out).
func ErrorEvent(e *Error) []byte {
	return append(append([]byte("data: "), e.Body()...), '\n', '\n')
}

var (
	contentKey      = []byte(`"content":"`)
	emptyContentKey = []byte(`"content":""`)
	textKey         = []byte(`"text":"`)
	emptyTextKey    = []byte(`"text":""`)
)

// hasText reports whether a chunk carries generated text (chat delta
// content or completion text), compactly encoded as engines send it.
func hasText(p []byte) bool {
	return bytes.Contains(p, contentKey) && !bytes.Contains(p, emptyContentKey) ||
		bytes.Contains(p, textKey) && !bytes.Contains(p, emptyTextKey)
}

// ssePayload returns the data of an event (its data lines joined), nil for
// an event without data.
func ssePayload(ev []byte) []byte {
	var out []byte
	n := 0
	for len(ev) > 0 {
		line := ev
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			ev = nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		v, ok := bytes.CutPrefix(line, dataPrefix)
		if !ok {
			continue
		}
		v = bytes.TrimPrefix(v, []byte{' '})
		if n == 0 {
			out = v
		} else {
			out = append(append(append([]byte(nil), out...), '\n'), v...)
		}
		n++
	}
	return out
}
