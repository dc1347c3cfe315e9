package vllmsim

// tooluse.go answers with a tool call when the request forces one. vLLM
// calls a tool when the model's output parses as one (with a tool-call
// parser enabled); the simulated model generates no such text, so the
// simulator calls a tool exactly when the request leaves no choice:
// Anthropic's tool_choice {"type":"any"} or {"type":"tool","name":…},
// Responses' tool_choice "required" or {"type":"function","name":…}. The
// call names the forced tool (the first one for "any"/"required") and its
// input is built from the tool's JSON schema (forcedInput), so a test
// knows it in advance. The engine generates its tokens as for any answer:
// usage counts them; the tool call replaces the text.

import (
	"bytes"
	"encoding/json"
	"sort"
	"strings"
)

// forcedTool returns the tool the request forces and the input of the
// call (ok false: the request forces none). responses selects the
// Responses shapes (tools {"type":"function","name","parameters"},
// tool_choice "required"); otherwise Anthropic's (tools {"name",
// "input_schema"}, tool_choice {"type":"any"|"tool"}).
func forcedTool(tools, choice json.RawMessage, responses bool) (name string, input json.RawMessage, ok bool) {
	choice = bytes.TrimSpace(choice)
	if len(choice) == 0 || string(choice) == "null" {
		return "", nil, false
	}
	var want string
	var c struct {
		Type string `json:"type"`
		Name string `json:"name"`
	}
	switch {
	case responses && string(choice) == `"required"`:
	case choice[0] != '{' || json.Unmarshal(choice, &c) != nil:
		return "", nil, false
	case !responses && c.Type == "any", !responses && c.Type == "tool", responses && c.Type == "function":
		want = c.Name
	default:
		return "", nil, false
	}
	var ts []struct {
		Type        string          `json:"type"`
		Name        string          `json:"name"`
		InputSchema json.RawMessage `json:"input_schema"`
		Parameters  json.RawMessage `json:"parameters"`
	}
	if json.Unmarshal(tools, &ts) != nil {
		return "", nil, false
	}
	for _, t := range ts {
		if responses && t.Type != "function" || want != "" && t.Name != want {
			continue
		}
		schema := t.InputSchema
		if responses {
			schema = t.Parameters
		}
		return t.Name, forcedInput(schema), true
	}
	return "", nil, false
}

// forcedInput is the input of a forced call: an object with every
// property of the schema, in name order, set by its type — string "sim",
// integer and number 1, boolean true, array [], object {}, anything else
// null.
func forcedInput(schema json.RawMessage) json.RawMessage {
	var s struct {
		Properties map[string]struct {
			Type any `json:"type"`
		} `json:"properties"`
	}
	_ = json.Unmarshal(schema, &s)
	names := make([]string, 0, len(s.Properties))
	for n := range s.Properties {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	b.WriteByte('{')
	for i, n := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(n)
		b.Write(k)
		b.WriteByte(':')
		typ, _ := s.Properties[n].Type.(string)
		switch typ {
		case "string":
			b.WriteString(`"sim"`)
		case "integer", "number":
			b.WriteString("1")
		case "boolean":
			b.WriteString("true")
		case "array":
			b.WriteString("[]")
		case "object":
			b.WriteString("{}")
		default:
			b.WriteString("null")
		}
	}
	b.WriteByte('}')
	return json.RawMessage(b.String())
}

// jsonPieces splits a call's input into the pieces streamed as its
// argument deltas, one per generated token while pieces last (the rest
// goes with the last token).
type jsonPieces struct {
	rest string
}

// next returns the next piece (at most 8 bytes; "" once all are out).
func (p *jsonPieces) next() string {
	n := min(8, len(p.rest))
	out := p.rest[:n]
	p.rest = p.rest[n:]
	return out
}
