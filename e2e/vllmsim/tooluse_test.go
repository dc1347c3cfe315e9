package vllmsim

import (
	"encoding/json"
	"testing"
)

func TestForcedTool(t *testing.T) {
	anth := json.RawMessage(`[{"name":"a","input_schema":{"properties":{"x":{"type":"integer"}}}},` +
		`{"name":"b","input_schema":{"properties":{"s":{"type":"string"},"f":{"type":"boolean"},"l":{"type":"array"},"o":{"type":"object"},"n":{"type":["string","null"]}}}}]`)
	resp := json.RawMessage(`[{"type":"web_search"},{"type":"function","name":"b","parameters":{"properties":{"q":{"type":"number"}}}}]`)
	for _, c := range []struct {
		tools, choice string
		responses     bool
		name, input   string
		ok            bool
	}{
		{string(anth), `{"type":"any"}`, false, "a", `{"x":1}`, true},
		{string(anth), `{"type":"tool","name":"b"}`, false, "b", `{"f":true,"l":[],"n":null,"o":{},"s":"sim"}`, true},
		{string(anth), `{"type":"auto"}`, false, "", "", false},
		{string(anth), ``, false, "", "", false},
		{string(anth), `{"type":"tool","name":"zz"}`, false, "", "", false},
		{string(resp), `"required"`, true, "b", `{"q":1}`, true},
		{string(resp), `{"type":"function","name":"b"}`, true, "b", `{"q":1}`, true},
		{string(resp), `"auto"`, true, "", "", false},
	} {
		name, input, ok := forcedTool(json.RawMessage(c.tools), json.RawMessage(c.choice), c.responses)
		if name != c.name || string(input) != c.input || ok != c.ok {
			t.Errorf("%s %s: got %q %s %v, want %q %s %v", c.tools, c.choice, name, input, ok, c.name, c.input, c.ok)
		}
	}
	p := jsonPieces{rest: `{"pkg":"sim","verbose":true}`}
	var all string
	for s := p.next(); s != ""; s = p.next() {
		if len(s) > 8 {
			t.Fatalf("piece %q", s)
		}
		all += s
	}
	if all != `{"pkg":"sim","verbose":true}` {
		t.Fatalf("pieces add up to %q", all)
	}
}
