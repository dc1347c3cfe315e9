// Package anthropic is the Anthropic Messages wire format of the data
// plane and nothing else: the request body reader (ParseMessages, over
// openai's scanner so that a body is validated the same way on every
// route), the error shape and its table from Sluice's codes (errors.go),
// the anthropic-ratelimit-* headers (headers.go) and the usage of complete
// answers and SSE streams (usage.go). It is pure: no I/O beyond the
// ResponseWriter it is handed, no catalog, no metrics.
package anthropic

import (
	"bytes"
	"encoding/json"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// Routes.
const (
	RouteMessages = "/v1/messages"
	// RouteCountTokens is not served (docs/protocols.md): it answers a
	// typed 404.
	RouteCountTokens = "/v1/messages/count_tokens"
)

// Protocol is the value of a deployment's capabilities.protocols that
// lets it serve the routes of this package.
const Protocol = "anthropic_messages"

// ParseMessages reads a POST /v1/messages body: model (required),
// max_tokens (required, at least 1: Anthropic's API requires it),
// messages (required, an array of message objects), system, tools and
// tool_choice, stream. Images (image or document content blocks) need a
// vision deployment; tools need tool calling.
func ParseMessages(body []byte) (*openai.Request, *openai.Error) {
	return openai.ParseWith(body, derive)
}

func derive(value func(string) []byte) (openai.Derived, *openai.Error) {
	var d openai.Derived
	var e *openai.Error
	if d.Stream, e = openai.StreamBool(value("stream"), "stream"); e != nil {
		return d, e
	}
	n, set, e := openai.NonNegativeInt(value("max_tokens"), "max_tokens")
	switch {
	case e != nil:
		return d, e
	case !set:
		return d, openai.InvalidRequest(openai.CodeMissingRequiredParam, "max_tokens", "max_tokens: field required")
	case n < 1:
		return d, openai.InvalidRequest(openai.CodeInvalidParameter, "max_tokens", "max_tokens must be at least 1")
	}
	d.MaxTokens, d.MaxTokensParam = n, "max_tokens"
	msgs := value("messages")
	if openai.IsNull(msgs) {
		return d, openai.InvalidRequest(openai.CodeMissingRequiredParam, "messages", "messages: field required")
	}
	n, images, ok := estimateBlocks(msgs)
	if !ok {
		return d, openai.InvalidRequest(openai.CodeInvalidParameter, "messages", "messages must be an array of message objects with string or content-block content")
	}
	d.PromptEstimate, d.Images = n, images
	if v := value("system"); !openai.IsNull(v) {
		switch v[0] {
		case '"':
			d.PromptEstimate += int64(len(v)) / 4
		case '[':
			n, _, ok := estimateContent(v)
			if !ok {
				return d, openai.InvalidRequest(openai.CodeInvalidParameter, "system", "system must be a string or an array of text blocks")
			}
			d.PromptEstimate += n
		default:
			return d, openai.InvalidRequest(openai.CodeInvalidParameter, "system", "system must be a string or an array of text blocks")
		}
	}
	if v := value("tools"); !openai.IsNull(v) {
		if v[0] != '[' {
			return d, openai.InvalidRequest(openai.CodeInvalidParameter, "tools", "tools must be an array")
		}
		d.Tools = v[openai.SkipWS(v, 1)] != ']'
		d.PromptEstimate += int64(len(v)) / 4
	}
	if v := value("tool_choice"); !openai.IsNull(v) {
		if v[0] != '{' {
			return d, openai.InvalidRequest(openai.CodeInvalidParameter, "tool_choice", "tool_choice must be an object")
		}
		var tc struct {
			Type string `json:"type"`
		}
		if json.Unmarshal(v, &tc) != nil {
			return d, openai.InvalidRequest(openai.CodeInvalidParameter, "tool_choice", "tool_choice must be an object with a type")
		}
		if tc.Type != "none" && tc.Type != "" {
			d.Tools = d.Tools || tc.Type == "any" || tc.Type == "tool"
		}
	}
	return d, nil
}

// estimateBlocks estimates the tokens of a messages array (about 4 bytes
// of text per token) and says whether it carries images. Only when the raw
// text mentions an image or document block is it decoded (their base64
// data would otherwise dominate a size-based estimate).
func estimateBlocks(v []byte) (tokens int64, images, ok bool) {
	if v[0] != '[' {
		return 0, false, false
	}
	if !bytes.Contains(v, []byte(`"image"`)) && !bytes.Contains(v, []byte(`"document"`)) {
		// v is valid JSON (ParseWith checked the body): step over its
		// elements rather than decode them.
		for i := openai.SkipWS(v, 1); v[i] != ']'; {
			if v[i] != '{' {
				return 0, false, false
			}
			if i = openai.SkipWS(v, openai.SkipValue(v, i)); v[i] == ',' {
				i = openai.SkipWS(v, i+1)
			}
		}
		return int64(len(v)) / 4, false, true
	}
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(v, &msgs) != nil {
		return 0, false, false
	}
	for _, m := range msgs {
		switch {
		case len(m.Content) == 0:
		case m.Content[0] == '"':
			tokens += int64(len(m.Content)) / 4
		case m.Content[0] == '[':
			n, img, ok := estimateContent(m.Content)
			if !ok {
				return 0, false, false
			}
			tokens += n
			images = images || img
		default:
			return 0, false, false
		}
	}
	return tokens, images, true
}

// estimateContent estimates an array of content blocks: the text of text
// blocks, the JSON of tool_use and tool_result blocks, and a fixed cost
// per image or document (their data is not text).
func estimateContent(v []byte) (tokens int64, images, ok bool) {
	var blocks []struct {
		Type    string          `json:"type"`
		Text    string          `json:"text"`
		Input   json.RawMessage `json:"input"`
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(v, &blocks) != nil {
		return 0, false, false
	}
	var text int64
	for _, b := range blocks {
		switch b.Type {
		case "image", "document":
			images = true
			tokens += imageTokens
		default:
			text += int64(len(b.Text) + len(b.Input) + len(b.Content))
		}
	}
	return tokens + text/4, images, true
}

// imageTokens is the estimate of one image or document block (Anthropic
// bills an image of about 1.15 megapixels at about 1600 tokens).
const imageTokens = 1600
