package authn

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/internal/labels"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// DefaultJWTSkew is the clock skew allowed on exp and nbf.
const DefaultJWTSkew = 30 * time.Second

// jwtAlgorithms are the only algorithms a token may name: asymmetric
// signatures. "none" and the HMAC family are refused before any key is
// looked at (an HMAC "verified" with a public key is the classic JWT
// forgery).
var jwtAlgorithms = []jose.SignatureAlgorithm{
	jose.RS256, jose.RS384, jose.RS512, jose.PS256, jose.PS384, jose.PS512,
	jose.ES256, jose.ES384, jose.ES512, jose.EdDSA,
}

// maxJWTBytes bounds a presented token (headers are bounded anyway; this
// keeps parsing cheap).
const maxJWTBytes = 16 << 10

// JWT authenticates bearer JWTs of the orgs' trusted issuers: the token is
// verified locally against its issuer's keys (Keys), its "alg" must be one
// its key is for, exp is required and exp/nbf are checked with Skew; the
// claims named by the issuer's mappings pick the org's team and user,
// which bring their limits, budgets, classes and blocks as for keys.
type JWT struct {
	Keys *JWKS
	// Skew is the allowed clock skew (0: DefaultJWTSkew).
	Skew time.Duration
}

// Authenticate implements Authenticator.
func (j *JWT) Authenticate(dir Directory, r *http.Request, now time.Time) (*Principal, *openai.Error) {
	raw, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || raw == "" {
		return nil, openai.Unauthorized(openai.CodeMissingAPIKey, "no credential: send Authorization: Bearer <key or JWT>")
	}
	if len(raw) > maxJWTBytes {
		return nil, invalidToken("the token is longer than %d bytes", maxJWTBytes)
	}
	tok, err := jwt.ParseSigned(raw, jwtAlgorithms)
	if err != nil {
		return nil, invalidToken("not a JWT signed with an asymmetric algorithm (%s)", algNames())
	}
	if len(tok.Headers) != 1 {
		return nil, invalidToken("the token must carry exactly one signature")
	}
	hdr := tok.Headers[0]
	var unverified jwt.Claims
	if err := tok.UnsafeClaimsWithoutVerification(&unverified); err != nil {
		return nil, invalidToken("the token's claims are not a JSON object with standard claims")
	}
	ti := dir.TrustedIssuer(unverified.Issuer, unverified.Audience)
	if ti == nil {
		if dir.HasIssuer(unverified.Issuer) {
			return nil, openai.Unauthorized(openai.CodeInvalidAudience, "the token's audience is not one its issuer is trusted for")
		}
		return nil, openai.Unauthorized(openai.CodeUntrustedIssuer, "the token's issuer is not trusted by any org")
	}
	if hdr.KeyID == "" {
		return nil, invalidToken("the token's header names no kid")
	}
	ctx, cancel := context.WithTimeout(r.Context(), j.Keys.cfg.FetchTimeout)
	defer cancel()
	key, err := j.Keys.Key(ctx, ti.GetJwksUrl(), ti.GetIssuer(), hdr.KeyID)
	switch {
	case errors.Is(err, ErrUnknownKID):
		return nil, openai.Unauthorized(openai.CodeUnknownSigningKey, "the issuer's keys hold no key with the token's kid")
	case err != nil:
		return nil, openai.Unauthorized(openai.CodeSigningKeysUnavailable, "the issuer's signing keys cannot be fetched; retry later")
	}
	if !slices.Contains(algorithmsOf(key), jose.SignatureAlgorithm(hdr.Algorithm)) {
		return nil, invalidToken("the token's alg %q is not the algorithm of its key", hdr.Algorithm)
	}
	var std jwt.Claims
	claims := map[string]any{}
	if err := tok.Claims(key.Key, &std, &claims); err != nil {
		return nil, invalidToken("the token's signature does not verify")
	}
	if std.Expiry == nil {
		return nil, invalidToken("the token has no exp")
	}
	skew := j.Skew
	if skew == 0 {
		skew = DefaultJWTSkew
	}
	err = std.ValidateWithLeeway(jwt.Expected{Issuer: ti.GetIssuer(), AnyAudience: jwt.Audience{ti.GetAudience()}, Time: now}, skew)
	switch {
	case errors.Is(err, jwt.ErrExpired):
		return nil, openai.Unauthorized(openai.CodeTokenExpired, "the token has expired")
	case errors.Is(err, jwt.ErrNotValidYet), errors.Is(err, jwt.ErrIssuedInTheFuture):
		return nil, openai.Unauthorized(openai.CodeTokenExpired, "the token is not valid yet (nbf or iat in the future)")
	case err != nil:
		return nil, invalidToken("the token's claims do not validate")
	}
	return ClaimsPrincipal(dir, ti, std.Subject, claims)
}

// ClaimsPrincipal maps the claims of a token of ti, once verified, to a
// principal by the issuer's claim mappings (Authenticate; explain runs it
// on synthetic claims). The principal comes with *_blocked errors too.
func ClaimsPrincipal(dir Directory, ti *configv1.TrustedIssuer, subject string, claims map[string]any) (*Principal, *openai.Error) {
	id := Identity{Subject: subject}
	for _, m := range []struct {
		claim string
		dst   *string
	}{{ti.GetTeamClaim(), &id.Team}, {ti.GetUserClaim(), &id.User}, {ti.GetCustomerClaim(), &id.Customer}} {
		if m.claim == "" {
			continue
		}
		v, ok := ClaimString(claims, m.claim)
		if !ok {
			return nil, invalidToken("the claim %q is not a string or number", m.claim)
		}
		*m.dst = v
	}
	if c := ti.GetProjectClaim(); c != "" {
		v, ok := ClaimString(claims, c)
		if !ok {
			return nil, invalidToken("the claim %q is not a string or number", c)
		}
		if v != "" {
			if err := labels.Project(v); err != nil {
				return nil, invalidToken("the claim %q is not a project: %v", c, err)
			}
		}
		id.Project = v
	}
	if c := ti.GetTagsClaim(); c != "" {
		v, ok := ClaimStrings(claims, c)
		if !ok {
			return nil, invalidToken("the claim %q is not an array of strings (or a string)", c)
		}
		if err := labels.Tags(v); err != nil {
			return nil, invalidToken("the claim %q does not hold tags: %v", c, err)
		}
		id.Tags = v
	}
	p, err := dir.JWTPrincipal(ti, id)
	var blocked *BlockedError
	switch {
	case err == nil:
		return p, nil
	case errors.As(err, &blocked):
		return p, openai.Forbidden(openai.BlockedCode(blocked.Scope), "", "access denied: the "+blocked.Scope+" of this token is blocked")
	case errors.Is(err, ErrUnknownTeam):
		return nil, openai.Unauthorized(openai.CodeUnknownIdentity, "the token's team claim names no team of the org")
	case errors.Is(err, ErrUnknownUser):
		return nil, openai.Unauthorized(openai.CodeUnknownIdentity, "the token's user claim names no user of the org")
	}
	return nil, openai.Unauthorized(openai.CodeUntrustedIssuer, "the token's issuer no longer has an org")
}

func invalidToken(format string, args ...any) *openai.Error {
	return openai.Unauthorized(openai.CodeInvalidToken, fmt.Sprintf(format, args...))
}

func algNames() string {
	names := make([]string, len(jwtAlgorithms))
	for i, a := range jwtAlgorithms {
		names[i] = string(a)
	}
	return strings.Join(names, ", ")
}

// ClaimStrings returns the claim at a dot path as a list of strings: an
// array of strings or numbers, or one string or number (a list of one); a
// missing claim (or an empty string) as none (ok). Other types are not ok.
func ClaimStrings(claims map[string]any, path string) ([]string, bool) {
	parent, last := claims, path
	if i := strings.LastIndex(path, "."); i >= 0 {
		var v any = claims
		for part := range strings.SplitSeq(path[:i], ".") {
			m, isMap := v.(map[string]any)
			if !isMap {
				return nil, v == nil
			}
			if v = m[part]; v == nil {
				return nil, true
			}
		}
		m, isMap := v.(map[string]any)
		if !isMap {
			return nil, false
		}
		parent, last = m, path[i+1:]
	}
	arr, isArr := parent[last].([]any)
	if !isArr {
		s, ok := ClaimString(parent, last)
		if !ok || s == "" {
			return nil, ok
		}
		return []string{s}, true
	}
	out := make([]string, 0, len(arr))
	for _, e := range arr {
		s, ok := ClaimString(map[string]any{"v": e}, "v")
		if !ok || e == nil {
			return nil, false
		}
		out = append(out, s)
	}
	return out, true
}

// ClaimString returns the claim at a dot path ("realm.team" is
// claims["realm"]["team"]) as a string: strings as they are, numbers in
// decimal, a missing claim as "" (ok). Other types (objects, arrays,
// booleans) are not ok: a mapping that points at them is a mistake.
func ClaimString(claims map[string]any, path string) (string, bool) {
	var v any = claims
	for part := range strings.SplitSeq(path, ".") {
		m, isMap := v.(map[string]any)
		if !isMap {
			return "", v == nil
		}
		if v = m[part]; v == nil {
			return "", true
		}
	}
	switch x := v.(type) {
	case string:
		return x, true
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64), true
	}
	return "", false
}
