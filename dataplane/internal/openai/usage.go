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
	u := new(Usage)
	if decodeUsage(v, u) {
		return u
	}
	*u = Usage{}
	if json.Unmarshal(v, u) != nil {
		return nil
	}
	return u
}

// decodeUsage decodes a usage object json.Valid accepted as
// json.Unmarshal would, without reflection, when it is the common shape:
// ASCII member names without escapes and integer literals (or null) for
// the members Usage has. ok is false for anything else (the caller then
// decodes it with encoding/json, errors included), u then being partly
// set.
func decodeUsage(v []byte, u *Usage) (ok bool) {
	return decodeMembers(v, func(name, val []byte) bool {
		switch {
		case asciiFold(name, "prompt_tokens"):
			return decodeInt(val, &u.PromptTokens)
		case asciiFold(name, "completion_tokens"):
			return decodeInt(val, &u.CompletionTokens)
		case asciiFold(name, "prompt_tokens_details"):
			if string(val) == "null" {
				u.PromptTokensDetails = nil // as encoding/json: null clears a pointer
				return true
			}
			if u.PromptTokensDetails == nil {
				u.PromptTokensDetails = &struct {
					CachedTokens int64 `json:"cached_tokens"`
				}{}
			}
			d := u.PromptTokensDetails
			return decodeMembers(val, func(name, val []byte) bool {
				if asciiFold(name, "cached_tokens") {
					return decodeInt(val, &d.CachedTokens)
				}
				return true
			})
		}
		return true // a member Usage does not have: skipped, as encoding/json does
	})
}

// decodeMembers calls member for each member of the object v (valid
// JSON) in order, with its name (without quotes) and value; false when v
// is not an object, a name is not plain ASCII without escapes, or member
// returns false.
func decodeMembers(v []byte, member func(name, val []byte) bool) bool {
	i := skipWS(v, 0)
	if i >= len(v) || v[i] != '{' {
		return false
	}
	for i = skipWS(v, i+1); v[i] != '}'; {
		ks := i
		i = skipString(v, i)
		name := v[ks+1 : i-1]
		for _, c := range name {
			if c == '\\' || c >= 0x80 {
				return false
			}
		}
		i = skipWS(v, skipWS(v, i)+1) // ':'
		vs := i
		i = skipValue(v, i)
		if !member(name, v[vs:i]) {
			return false
		}
		if i = skipWS(v, i); v[i] == ',' {
			i = skipWS(v, i+1)
		}
	}
	return true
}

// decodeInt sets *n to the integer literal val (null leaves it, as
// encoding/json does); false for anything else or past 18 digits.
func decodeInt(val []byte, n *int64) bool {
	if string(val) == "null" {
		return true
	}
	neg := len(val) > 0 && val[0] == '-'
	d := val
	if neg {
		d = val[1:]
	}
	if len(d) == 0 || len(d) > 18 || (len(d) > 1 && d[0] == '0') {
		return false
	}
	var x int64
	for _, c := range d {
		if c < '0' || c > '9' {
			return false
		}
		x = x*10 + int64(c-'0')
	}
	if neg {
		x = -x
	}
	*n = x
	return true
}

// asciiFold reports whether the ASCII name equals want (lower case) but
// for case, as encoding/json matches member names to fields.
func asciiFold(name []byte, want string) bool {
	if len(name) != len(want) {
		return false
	}
	for i, c := range name {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != want[i] {
			return false
		}
	}
	return true
}
