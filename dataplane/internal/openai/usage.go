package openai

import "encoding/json"

// Usage is OpenAI's usage object.
type Usage struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	// CacheCreationTokens are prompt tokens written to the engine's
	// prompt cache (Anthropic's cache_creation_input_tokens; counted in
	// PromptTokens too). Not part of OpenAI's object.
	CacheCreationTokens int64 `json:"-"`
}

// CachedTokens is prompt_tokens_details.cached_tokens (0 when absent).
func (u *Usage) CachedTokens() int64 {
	if u.PromptTokensDetails == nil {
		return 0
	}
	return u.PromptTokensDetails.CachedTokens
}

// BodyUsage reads the usage object of a complete (non-streamed) answer:
// nil when b is not valid JSON or carries none.
func BodyUsage(b []byte) *Usage {
	if !json.Valid(b) {
		return nil
	}
	v := memberValue(b, "usage")
	if isNull(v) {
		return nil
	}
	var u Usage
	if json.Unmarshal(v, &u) != nil {
		return nil
	}
	return &u
}
