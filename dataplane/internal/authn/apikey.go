package authn

import (
	"net/http"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

// HeaderAPIKey is the header Anthropic's clients send their key in.
const HeaderAPIKey = "X-Api-Key"

// APIKeyOrBearer authenticates the same virtual keys as VirtualKeys, sent
// either as "x-api-key: sk-sluice-..." (Anthropic's SDKs with an API key)
// or as "Authorization: Bearer sk-sluice-..." (with an auth token, as
// Claude Code's ANTHROPIC_AUTH_TOKEN sends it). When both are sent they
// must name the same key: a request is never authenticated by one header
// while it shows another.
type APIKeyOrBearer struct {
	VirtualKeys
}

// Authenticate implements Authenticator.
func (a APIKeyOrBearer) Authenticate(dir Directory, r *http.Request, now time.Time) (*Principal, *openai.Error) {
	key := r.Header.Get(HeaderAPIKey)
	bearer, hasBearer := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	switch {
	case key == "" && (!hasBearer || bearer == ""):
		return nil, openai.Unauthorized(openai.CodeMissingAPIKey, "no API key: send x-api-key: sk-sluice-... or Authorization: Bearer sk-sluice-...")
	case key == "":
		key = bearer
	case hasBearer && bearer != "" && bearer != key:
		return nil, openai.Unauthorized(openai.CodeInvalidAPIKey, "x-api-key and Authorization name different keys; send one")
	}
	return a.token(dir, key, now)
}
