package authn

import (
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Directory is the configuration credentials are checked against: the
// catalog a request captured (catalog.Catalog implements it).
type Directory interface {
	// Authenticate finds the key of tok at now (ErrMalformed, ErrUnknown,
	// ErrExpired, *BlockedError; the principal comes with the last two).
	Authenticate(peppers *token.Peppers, tok string, now time.Time) (*Principal, error)
	// TrustedIssuer returns the trusted issuer of iss with one of the
	// audiences aud (nil for none); HasIssuer whether any org trusts iss.
	TrustedIssuer(iss string, aud []string) *configv1.TrustedIssuer
	HasIssuer(iss string) bool
	// JWTPrincipal maps a verified token's identity to a principal
	// (ErrUnknown, ErrUnknownTeam, ErrUnknownUser, *BlockedError; the
	// principal comes with the last).
	JWTPrincipal(ti *configv1.TrustedIssuer, id Identity) (*Principal, error)
}

// Authenticator authenticates a request from its headers. The principal
// is returned with key_expired and *_blocked errors too, for attribution;
// every failure is an answer of the error table (openai).
type Authenticator interface {
	Authenticate(dir Directory, r *http.Request, now time.Time) (*Principal, *openai.Error)
}

// VirtualKeys authenticates Sluice virtual keys sent as
// "Authorization: Bearer sk-sluice-...".
type VirtualKeys struct {
	Peppers *token.Peppers
}

// Authenticate implements Authenticator.
func (v VirtualKeys) Authenticate(dir Directory, r *http.Request, now time.Time) (*Principal, *openai.Error) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return nil, openai.Unauthorized(openai.CodeMissingAPIKey, "no API key: send Authorization: Bearer sk-sluice-...")
	}
	return v.token(dir, tok, now)
}

// token authenticates a presented virtual key.
func (v VirtualKeys) token(dir Directory, tok string, now time.Time) (*Principal, *openai.Error) {
	p, err := dir.Authenticate(v.Peppers, tok, now)
	var blocked *BlockedError
	switch {
	case err == nil:
		return p, nil
	case errors.As(err, &blocked):
		return p, openai.Forbidden(openai.BlockedCode(blocked.Scope), "", "access denied: the "+blocked.Scope+" of this key is blocked")
	case errors.Is(err, ErrExpired):
		return p, openai.Unauthorized(openai.CodeKeyExpired, "this API key has expired")
	case errors.Is(err, ErrMalformed):
		return nil, openai.Unauthorized(openai.CodeInvalidAPIKey, "the API key is malformed or mistyped (checksum mismatch)")
	}
	return nil, openai.Unauthorized(openai.CodeInvalidAPIKey, "unknown or deleted API key")
}

// Credentials authenticates by the shape of the bearer credential: a
// Sluice virtual key ("sk-sluice-...") goes to Keys, a compact JWS (three
// dot-separated parts) to JWT when it is set. Without JWT every bearer is
// a key.
type Credentials struct {
	Keys VirtualKeys
	JWT  *JWT
}

// Authenticate implements Authenticator.
func (c Credentials) Authenticate(dir Directory, r *http.Request, now time.Time) (*Principal, *openai.Error) {
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if c.JWT != nil && !strings.HasPrefix(tok, token.KeyPrefix) && strings.Count(tok, ".") == 2 {
		return c.JWT.Authenticate(dir, r, now)
	}
	return c.Keys.Authenticate(dir, r, now)
}
