package openai

import "testing"

func TestParseResponses(t *testing.T) {
	r, e := ParseResponses([]byte(`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hi"},{"type":"input_image","image_url":"x"}]}],
		"tools":[{"type":"function","name":"f"}],"max_output_tokens":9,"text":{"format":{"type":"json_schema"}},"stream":true,"previous_response_id":"resp_1"}`))
	if e != nil {
		t.Fatal(e)
	}
	if !r.Stream() || r.MaxTokens() != 9 || r.MaxTokensParam() != "max_output_tokens" || !r.Tools() || !r.Images() || !r.JSONMode() || PreviousResponseID(r) != "resp_1" {
		t.Fatalf("%+v", r)
	}
	if _, e := ParseResponses([]byte(`{"model":"m","previous_response_id":"resp_1"}`)); e != nil {
		t.Fatal("a follow-up may omit input:", e)
	}
	for _, b := range []string{`{"model":"m"}`, `{"model":"m","input":3}`, `{"model":"m","input":"x","previous_response_id":7}`,
		`{"model":"m","input":"x","max_output_tokens":-1}`, `{"model":"m","input":"x","text":[]}`} {
		if _, e := ParseResponses([]byte(b)); e == nil {
			t.Errorf("%s accepted", b)
		}
	}
}

func TestResponsesEvents(t *testing.T) {
	e := ParseResponsesEvent([]byte("event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_a\",\"usage\":null}}\n\n"))
	if e.ResponseID != "resp_a" || e.Usage != nil || e.Done {
		t.Fatalf("%+v", e)
	}
	if e := ParseResponsesEvent([]byte("data: {\"type\":\"response.output_text.delta\",\"delta\":\"x\"}\n\n")); !e.Text {
		t.Fatal("delta")
	}
	e = ParseResponsesEvent([]byte("data: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_a\",\"usage\":{\"input_tokens\":5,\"output_tokens\":2,\"input_tokens_details\":{\"cached_tokens\":3}}}}\n\n"))
	if !e.Done || e.Usage == nil || e.Usage.PromptTokens != 5 || e.Usage.CompletionTokens != 2 || e.Usage.CachedTokens() != 3 {
		t.Fatalf("%+v", e)
	}
	if e := ParseResponsesEvent([]byte("data: {\"type\":\"response.failed\",\"response\":{}}\n\n")); !e.Done || !e.Error {
		t.Fatal("failed")
	}
	id, u := ResponseBody([]byte(`{"id":"resp_b","usage":{"input_tokens":1,"output_tokens":1}}`))
	if id != "resp_b" || u == nil || u.PromptTokens != 1 {
		t.Fatal(id, u)
	}
}

func FuzzParseResponses(f *testing.F) {
	f.Add([]byte(`{"model":"m","input":"hi","stream":true}`))
	f.Add([]byte(`{"model":"m","input":[{"content":[{"type":"input_image"}]}],"text":{"format":{"type":"json_object"}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, e := ParseResponses(b)
		if (r == nil) == (e == nil) {
			t.Fatal("exactly one of request and error")
		}
		if r != nil && (r.MaxTokens() < 0 || r.PromptEstimate() < 0) {
			t.Fatalf("%+v", r)
		}
		ev := ParseResponsesEvent(b)
		if ev.Usage != nil && (ev.Usage.PromptTokens < 0 || ev.Usage.CompletionTokens < 0) {
			t.Fatalf("%+v", ev.Usage)
		}
	})
}
