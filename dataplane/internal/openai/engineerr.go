package openai

import (
	"encoding/json"
	"fmt"
	"strings"
)

// EngineMessage reads the message and parameter of an engine's error
// answer (see engineMessage); the caller sanitises the message before it
// reaches a client.
func EngineMessage(b []byte) (msg, param string) { return engineMessage(b) }

// engineMessage reads the message (and the parameter, when it names one)
// of an engine's error answer: vLLM's and OpenAI's {"error": {"message",
// "param"}}, {"error": "…"}, older vLLM's {"message", "param"}, FastAPI's {"detail": "…"}
// and its validation list {"detail": [{"loc": [...], "msg": "…"}]} (only
// locations and messages: never the "input" it echoes).
func engineMessage(b []byte) (msg, param string) {
	var v struct {
		Error   json.RawMessage `json:"error"`
		Message *string         `json:"message"`
		Param   json.RawMessage `json:"param"`
		Detail  json.RawMessage `json:"detail"`
	}
	if json.Unmarshal(b, &v) != nil {
		return "", ""
	}
	if len(v.Error) > 0 {
		var eo struct {
			Message string          `json:"message"`
			Param   json.RawMessage `json:"param"`
		}
		var es string
		switch {
		case v.Error[0] == '{' && json.Unmarshal(v.Error, &eo) == nil:
			msg = eo.Message
			var p string
			if json.Unmarshal(eo.Param, &p) == nil && safeParam(p) {
				param = p
			}
		case json.Unmarshal(v.Error, &es) == nil:
			msg = es
		}
	}
	if msg == "" && v.Message != nil {
		msg = *v.Message
		var p string
		if json.Unmarshal(v.Param, &p) == nil && safeParam(p) {
			param = p
		}
	}
	if msg == "" && len(v.Detail) > 0 {
		var ds string
		var dl []struct {
			Loc []any  `json:"loc"`
			Msg string `json:"msg"`
		}
		switch {
		case json.Unmarshal(v.Detail, &ds) == nil:
			msg = ds
		case json.Unmarshal(v.Detail, &dl) == nil:
			parts := make([]string, 0, len(dl))
			for i, e := range dl {
				loc := locPath(e.Loc)
				if i == 0 && safeParam(loc) {
					param = loc
				}
				if loc != "" {
					parts = append(parts, loc+": "+e.Msg)
				} else {
					parts = append(parts, e.Msg)
				}
			}
			msg = strings.Join(parts, "; ")
		}
	}
	return msg, param
}

// EngineBackpressure reports whether an engine's 503 body is vLLM's
// admission valve (--max-num-queued-reqs: "cannot accept new requests";
// --max-num-queued-tokens: "prefill token backlog limit"): backpressure,
// to be routed elsewhere, not a failure of the deployment.
func EngineBackpressure(b []byte) bool {
	msg, _ := engineMessage(b)
	if msg == "" {
		return false
	}
	m := strings.ToLower(msg)
	return strings.Contains(m, "cannot accept new requests") || strings.Contains(m, "token backlog limit") ||
		strings.Contains(m, "queue is full") || strings.Contains(m, "queue full")
}

// locPath joins a FastAPI error location without its leading "body":
// ["body", "messages", 0] is "messages.0".
func locPath(loc []any) string {
	var parts []string
	for i, l := range loc {
		switch v := l.(type) {
		case string:
			if i == 0 && v == "body" {
				continue
			}
			parts = append(parts, v)
		case float64:
			parts = append(parts, fmt.Sprint(int64(v)))
		}
	}
	return strings.Join(parts, ".")
}

// safeParam reports whether p looks like a parameter path (letters,
// digits, _ . [ ] -, at most 64 bytes).
func safeParam(p string) bool {
	if p == "" || len(p) > 64 {
		return false
	}
	for _, c := range p {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("_.[]-", c)
		if !ok {
			return false
		}
	}
	return true
}
