package openai

import (
	"bytes"
	"encoding/json"
)

// The OpenAI Responses API (POST /v1/responses, GET /v1/responses/{id},
// POST /v1/responses/{id}/cancel): its body reader, the usage of a
// complete Response and of its stream of response.* events.

// RouteResponses is the Responses route.
const RouteResponses = "/v1/responses"

// ProtocolResponses is the value of a deployment's capabilities.protocols
// that lets it serve the Responses routes.
const ProtocolResponses = "openai_responses"

// ParseResponses reads a POST /v1/responses body: model (required),
// input (a string or an array of items; required unless
// previous_response_id continues a conversation), instructions, tools,
// max_output_tokens, text.format (json_schema or json_object: JSON mode),
// stream and previous_response_id (a string).
func ParseResponses(body []byte) (*Request, *Error) {
	return ParseWith(body, func(value func(string) []byte) (Derived, *Error) {
		var d Derived
		var e *Error
		if d.Stream, e = StreamBool(value("stream"), "stream"); e != nil {
			return d, e
		}
		n, set, e := NonNegativeInt(value("max_output_tokens"), "max_output_tokens")
		if e != nil {
			return d, e
		}
		if set {
			d.MaxTokens, d.MaxTokensParam = n, "max_output_tokens"
		}
		prev := value("previous_response_id")
		if !isNull(prev) {
			if _, ok := stringValue(prev); !ok {
				return d, parseError(CodeInvalidParameter, "previous_response_id", "previous_response_id must be a non-empty string")
			}
		}
		in := value("input")
		switch {
		case isNull(in) && isNull(prev):
			return d, parseError(CodeMissingRequiredParam, "input", "you must provide input")
		case isNull(in):
		case in[0] == '"':
			d.PromptEstimate += int64(len(in)) / 4
		case in[0] == '[':
			n, images, ok := estimateMessages(in)
			if !ok {
				return d, parseError(CodeInvalidParameter, "input", "input must be a string or an array of input items")
			}
			d.PromptEstimate, d.Images = n, images
		default:
			return d, parseError(CodeInvalidParameter, "input", "input must be a string or an array of input items")
		}
		if v := value("instructions"); !isNull(v) {
			d.PromptEstimate += int64(len(v)) / 4
		}
		if v := value("tools"); !isNull(v) {
			if v[0] != '[' {
				return d, parseError(CodeInvalidParameter, "tools", "tools must be an array")
			}
			d.Tools = v[skipWS(v, 1)] != ']'
			d.PromptEstimate += int64(len(v)) / 4
		}
		if v := value("text"); !isNull(v) {
			var t struct {
				Format *struct {
					Type string `json:"type"`
				} `json:"format"`
			}
			if v[0] != '{' || json.Unmarshal(v, &t) != nil {
				return d, parseError(CodeInvalidParameter, "text", "text must be an object")
			}
			d.JSONMode = t.Format != nil && t.Format.Type != "" && t.Format.Type != "text"
		}
		return d, nil
	})
}

// PreviousResponseID is a Responses body's previous_response_id ("" when
// absent).
func PreviousResponseID(r *Request) string {
	s, _ := stringValue(r.value("previous_response_id"))
	return s
}

// stringValue decodes a non-empty JSON string.
func stringValue(v []byte) (string, bool) {
	if isNull(v) || v[0] != '"' {
		return "", false
	}
	s, ok := plainString(v)
	if !ok && json.Unmarshal(v, &s) != nil {
		return "", false
	}
	return s, s != ""
}

// ResponsesUsage is the usage object of a Response.
type ResponsesUsage struct {
	InputTokens        int64 `json:"input_tokens"`
	OutputTokens       int64 `json:"output_tokens"`
	InputTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

// Usage returns u as Sluice accounts it.
func (u *ResponsesUsage) Usage() *Usage {
	out := &Usage{PromptTokens: max(u.InputTokens, 0), CompletionTokens: max(u.OutputTokens, 0)}
	if d := u.InputTokensDetails; d != nil {
		out.PromptTokensDetails = &struct {
			CachedTokens int64 `json:"cached_tokens"`
		}{CachedTokens: max(d.CachedTokens, 0)}
	}
	return out
}

// ResponseBody reads a complete Response: its id and usage (nil when it
// carries none).
func ResponseBody(b []byte) (id string, u *Usage) {
	if !json.Valid(b) {
		return "", nil
	}
	id, _ = stringValue(memberValue(b, "id"))
	v := memberValue(b, "usage")
	if isNull(v) {
		return id, nil
	}
	var ru ResponsesUsage
	if json.Unmarshal(v, &ru) != nil {
		return id, nil
	}
	return id, ru.Usage()
}

// ResponsesEvent is what the proxy reads of one response.* event.
type ResponsesEvent struct {
	Event
	// ResponseID is the id of the Response an event carries (response.created
	// and the terminal events).
	ResponseID string
}

var typePrefix = []byte(`"type"`)

// ParseResponsesEvent reads one SSE event of a Responses stream: Done at
// response.completed, response.incomplete or response.failed (the
// terminal events; failed is an Error too), Error for an error event,
// Usage from the terminal event's response.usage, Text for output text
// and function-call argument deltas, ResponseID from the events carrying
// the Response.
func ParseResponsesEvent(ev []byte) ResponsesEvent {
	payload := ssePayload(ev)
	if payload == nil {
		return ResponsesEvent{Event: Event{NoData: true}}
	}
	if !bytes.Contains(payload, typePrefix) {
		return ResponsesEvent{}
	}
	var e struct {
		Type     string `json:"type"`
		Response *struct {
			ID    string          `json:"id"`
			Usage *ResponsesUsage `json:"usage"`
		} `json:"response"`
	}
	if json.Unmarshal(payload, &e) != nil {
		return ResponsesEvent{}
	}
	var out ResponsesEvent
	if e.Response != nil {
		out.ResponseID = e.Response.ID
		if e.Response.Usage != nil {
			out.Usage = e.Response.Usage.Usage()
		}
	}
	switch e.Type {
	case "response.completed", "response.incomplete":
		out.Done = true
	case "response.failed":
		out.Done, out.Error = true, true
	case "error":
		out.Error = true
	case "response.output_text.delta", "response.function_call_arguments.delta", "response.reasoning_text.delta", "response.refusal.delta":
		out.Text = true
	}
	return out
}

// ResponsesErrorEvent is e as the error event of a Responses stream.
func ResponsesErrorEvent(e *Error) []byte {
	b, _ := json.Marshal(struct {
		Type    string  `json:"type"`
		Code    string  `json:"code"`
		Message string  `json:"message"`
		Param   *string `json:"param"`
	}{Type: "error", Code: e.Code, Message: e.Message})
	out := append([]byte("event: error\ndata: "), b...)
	return append(out, '\n', '\n')
}
