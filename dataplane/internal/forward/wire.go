package forward

import (
	"strings"

	"github.com/sluicegw/sluice/dataplane/internal/anthropic"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// wire is the wire format of a route's answers: how usage is read from a
// complete answer and from stream events, and how a failure is told in a
// stream once its headers are out. One per attempt (a stream's reader
// keeps state).
type wire interface {
	bodyUsage(b []byte) *openai.Usage
	event(ev []byte) openai.Event
	errorEvent(e *openai.Error) []byte
}

// ResponseRecorder is implemented by an Exchange that wants the id of the
// Response a Responses answer carries (to route follow-ups that name it
// in previous_response_id to the deployment holding it).
type ResponseRecorder interface {
	ResponseID(id string)
}

// wireFor returns the wire format of x's route.
func wireFor(x Exchange) wire {
	switch r := x.Route(); {
	case strings.HasPrefix(r, anthropic.RouteMessages):
		return &anthropicWire{}
	case r == openai.RouteResponses:
		rec, _ := x.(ResponseRecorder)
		return &responsesWire{rec: rec}
	}
	return openAIWire{}
}

type openAIWire struct{}

func (openAIWire) bodyUsage(b []byte) *openai.Usage        { return openai.BodyUsage(b) }
func (openAIWire) event(ev []byte) openai.Event            { return openai.ParseEvent(ev) }
func (openAIWire) errorEvent(e *openai.Error) []byte       { return openai.ErrorEvent(e) }
func (w *anthropicWire) bodyUsage(b []byte) *openai.Usage  { return anthropic.BodyUsage(b) }
func (w *anthropicWire) event(ev []byte) openai.Event      { return w.s.Event(ev) }
func (w *anthropicWire) errorEvent(e *openai.Error) []byte { return anthropic.ErrorEvent(e) }

type anthropicWire struct{ s anthropic.Stream }

type responsesWire struct {
	rec  ResponseRecorder
	seen bool
}

func (w *responsesWire) bodyUsage(b []byte) *openai.Usage {
	id, u := openai.ResponseBody(b)
	w.record(id)
	return u
}

func (w *responsesWire) event(ev []byte) openai.Event {
	e := openai.ParseResponsesEvent(ev)
	w.record(e.ResponseID)
	return e.Event
}

func (w *responsesWire) errorEvent(e *openai.Error) []byte { return openai.ResponsesErrorEvent(e) }

// record reports the first Response id seen.
func (w *responsesWire) record(id string) {
	if id != "" && !w.seen && w.rec != nil {
		w.seen = true
		w.rec.ResponseID(id)
	}
}
