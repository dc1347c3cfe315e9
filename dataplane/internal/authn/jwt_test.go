package authn_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/internal/oidctest"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

const aud = "sluice-test"

type jwtEnv struct {
	is   *oidctest.Issuer
	jwks *authn.JWKS
	auth authn.Credentials
	cat  *catalog.Catalog
}

func newJWTEnv(t *testing.T, cfg authn.JWKSConfig, edit func(*configv1.TrustedIssuer)) *jwtEnv {
	t.Helper()
	is := oidctest.Start(t)
	jwks, err := authn.NewJWKS(cfg)
	require.NoError(t, err)
	ti := &configv1.TrustedIssuer{Id: "iss1", OrgId: "o1", Issuer: is.URL(), Audience: aud, JwksUrl: is.JWKSURL(),
		TeamClaim: "realm.team", UserClaim: "email", CustomerClaim: "tenant",
		UnknownPolicy: configv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE}
	if edit != nil {
		edit(ti)
	}
	snap := &configv1.Snapshot{Version: 1,
		Orgs:           []*configv1.Org{{Id: "o1"}, {Id: "o2"}},
		Teams:          []*configv1.Team{{Id: "t1", OrgId: "o1", Name: "research"}, {Id: "t-def", OrgId: "o1", Name: "default"}, {Id: "t2", OrgId: "o2", Name: "other"}},
		Users:          []*configv1.User{{Id: "u1", OrgId: "o1", Email: "ada@example.com"}, {Id: "u2", OrgId: "o2", Email: "bob@example.com"}},
		Members:        []*configv1.Member{{TeamId: "t1", UserId: "u1", OrgId: "o1"}},
		TrustedIssuers: []*configv1.TrustedIssuer{ti},
	}
	cat, err := catalog.FromSnapshot(snap, 0, nil)
	require.NoError(t, err)
	return &jwtEnv{is: is, jwks: jwks, cat: cat, auth: authn.Credentials{JWT: &authn.JWT{Keys: jwks}}}
}

func (e *jwtEnv) check(tok string) (*authn.Principal, *openai.Error) {
	r, _ := http.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	r.Header.Set("Authorization", "Bearer "+tok)
	return e.auth.Authenticate(e.cat, r, time.Now())
}

func good(extra map[string]any) oidctest.Claims {
	c := oidctest.Claims{Subject: "sub-1", Audience: aud, Extra: map[string]any{
		"realm": map[string]any{"team": "research"}, "email": "Ada@Example.com", "tenant": "acme"}}
	for k, v := range extra {
		c.Extra[k] = v
	}
	return c
}

// TestJWTMapping: a token of a trusted issuer maps to the org's team (by
// name, through a nested claim) and user (by e-mail), with its end
// customer; a token for the user of another org, or a team the org does
// not have, is refused under the refuse policy.
func TestJWTMapping(t *testing.T) {
	t.Parallel()
	e := newJWTEnv(t, authn.JWKSConfig{}, nil)
	p, oe := e.check(e.is.Sign(good(nil)))
	require.Nil(t, oe)
	require.Equal(t, "o1", p.Org.GetId())
	require.Equal(t, "t1", p.Team.GetId())
	require.Equal(t, "u1", p.User.GetId())
	require.NotNil(t, p.Member)
	require.Equal(t, "acme", p.Customer)
	require.Equal(t, "sub-1", p.Subject)
	require.Equal(t, "jwt:iss1", p.Key.GetId())
	require.Equal(t, "t1", p.Key.GetTeamId())
	require.Equal(t, "u1", p.Key.GetUserId())

	// Team by id works too; a team of another org does not.
	p, oe = e.check(e.is.Sign(good(map[string]any{"realm": map[string]any{"team": "t-def"}})))
	require.Nil(t, oe)
	require.Equal(t, "t-def", p.Team.GetId())
	for name, extra := range map[string]map[string]any{
		"team of another org": {"realm": map[string]any{"team": "t2"}},
		"unknown team":        {"realm": map[string]any{"team": "nobody"}},
		"no team claim":       {"realm": map[string]any{}},
		"user of another org": {"email": "bob@example.com"},
		"unknown user":        {"email": "eve@example.com"},
	} {
		_, oe = e.check(e.is.Sign(good(extra)))
		require.NotNil(t, oe, name)
		require.Equal(t, http.StatusUnauthorized, oe.Status, name)
		require.Equal(t, openai.CodeUnknownIdentity, oe.Code, name)
	}
	_, oe = e.check(e.is.Sign(good(map[string]any{"realm": "flat"})))
	require.Equal(t, openai.CodeInvalidToken, oe.Code, "a dot path through a string")
}

// TestJWTDefaultTeam: under the default-team policy an unknown team runs
// as the default team and an unknown user is not attributed.
func TestJWTDefaultTeam(t *testing.T) {
	t.Parallel()
	e := newJWTEnv(t, authn.JWKSConfig{}, func(ti *configv1.TrustedIssuer) {
		ti.UnknownPolicy, ti.DefaultTeamId = configv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_DEFAULT_TEAM, "t-def"
	})
	p, oe := e.check(e.is.Sign(good(map[string]any{"realm": map[string]any{"team": "nobody"}, "email": "eve@example.com"})))
	require.Nil(t, oe)
	require.Equal(t, "t-def", p.Team.GetId())
	require.Nil(t, p.User)
	require.Empty(t, p.Key.GetUserId())
}

// TestJWTRefusals: every bad token is a typed 401.
func TestJWTRefusals(t *testing.T) {
	t.Parallel()
	e := newJWTEnv(t, authn.JWKSConfig{MinRefresh: time.Millisecond}, nil)
	unpubKid, unpub := e.is.NewUnpublishedKey()
	expired := good(nil)
	expired.Expiry = time.Now().Add(-time.Minute) // beyond the 30 s skew
	early := good(nil)
	early.NotBefore = time.Now().Add(time.Minute)
	noExp := good(nil)
	noExp.NoExpiry = true
	wrongAud := good(nil)
	wrongAud.Audience = "someone-else"
	for _, tc := range []struct {
		name, tok, code string
	}{
		{"wrong audience", e.is.Sign(wrongAud), openai.CodeInvalidAudience},
		{"expired", e.is.Sign(expired), openai.CodeTokenExpired},
		{"not yet valid", e.is.Sign(early), openai.CodeTokenExpired},
		{"no exp", e.is.Sign(noExp), openai.CodeInvalidToken},
		{"alg none", e.is.Unsigned(good(nil)), openai.CodeInvalidToken},
		{"HS256 with the public key", e.is.HS256WithPublicKey(good(nil)), openai.CodeInvalidToken},
		{"unknown kid", e.is.SignWith(unpubKid, jose.RS256, unpub, good(nil)), openai.CodeUnknownSigningKey},
		{"kid of a published key, signed by another", e.is.SignWith("k1", jose.RS256, unpub, good(nil)), openai.CodeInvalidToken},
		{"alg other than the key's", e.is.SignWith("k1", jose.PS256, unpub, good(nil)), openai.CodeInvalidToken},
		{"garbage", "a.b.c", openai.CodeInvalidToken},
	} {
		_, oe := e.check(tc.tok)
		require.NotNil(t, oe, tc.name)
		require.Equal(t, http.StatusUnauthorized, oe.Status, tc.name)
		require.Equal(t, tc.code, oe.Code, tc.name)
		require.Equal(t, openai.TypeInvalidRequest, oe.Type, tc.name)
	}
	other := oidctest.Start(t)
	_, oe := e.check(other.Sign(good(nil)))
	require.Equal(t, openai.CodeUntrustedIssuer, oe.Code)
}

// TestJWTRotation: the issuer rotates mid-test; a token of the new key is
// accepted at once (refresh on unknown kid, also for an EC key without
// "alg"), the withdrawn key stops after the next refresh, and tokens with
// made-up kids cause at most one fetch per MinRefresh.
func TestJWTRotation(t *testing.T) {
	t.Parallel()
	e := newJWTEnv(t, authn.JWKSConfig{MinRefresh: time.Hour}, func(ti *configv1.TrustedIssuer) { ti.JwksUrl = "" })
	old := e.is.Sign(good(nil))
	_, oe := e.check(old)
	require.Nil(t, oe, "through discovery")
	fetches := e.is.Fetches.Load()
	e.is.Rotate(false)
	// Within MinRefresh a new kid is refused (bounded refresh rate)...
	newTok := e.is.Sign(good(nil))
	_, oe = e.check(newTok)
	require.Equal(t, openai.CodeUnknownSigningKey, oe.Code)
	require.Equal(t, fetches, e.is.Fetches.Load(), "no fetch within MinRefresh")

	e = newJWTEnv(t, authn.JWKSConfig{MinRefresh: time.Millisecond}, nil)
	old = e.is.Sign(good(nil))
	_, oe = e.check(old)
	require.Nil(t, oe)
	e.is.RotateEC(false)
	_, oe = e.check(e.is.Sign(good(nil)))
	require.Nil(t, oe, "a new kid triggers a refresh")
	_, oe = e.check(old)
	require.Equal(t, openai.CodeUnknownSigningKey, oe.Code, "the withdrawn key is gone after the refresh")
}

// TestJWKSOutage: with the JWKS endpoint down, the cached keys keep
// working for the stale bound and new kids are refused; past the bound
// the issuer's tokens are refused (fail closed); when it is back they
// work again.
func TestJWKSOutage(t *testing.T) {
	t.Parallel()
	const stale = 3 * time.Second
	e := newJWTEnv(t, authn.JWKSConfig{RefreshInterval: 100 * time.Millisecond, MinRefresh: 50 * time.Millisecond, MaxStale: stale}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.jwks.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	tok := e.is.Sign(good(nil))
	_, oe := e.check(tok)
	require.Nil(t, oe)
	rotate := e.is.PrepareRotation()
	e.is.SetDown(true)
	down := time.Now()
	_, oe = e.check(tok)
	require.Nil(t, oe, "cached keys during the outage")
	rotate(true) // a new key the proxy cannot fetch
	fresh := e.is.Sign(good(nil))
	_, oe = e.check(fresh)
	require.Equal(t, openai.CodeUnknownSigningKey, oe.Code, "a new kid during the outage")
	_, oe = e.check(tok)
	require.Nil(t, oe, "cached keys during the outage")
	require.Eventually(t, func() bool {
		_, oe = e.check(tok)
		return oe != nil && oe.Code == openai.CodeSigningKeysUnavailable
	}, 10*time.Second, 20*time.Millisecond)
	require.GreaterOrEqual(t, time.Since(down), stale-150*time.Millisecond, "kept until the stale bound")
	e.is.SetDown(false)
	require.Eventually(t, func() bool {
		_, oe1 := e.check(tok)
		_, oe2 := e.check(fresh)
		return oe1 == nil && oe2 == nil
	}, 10*time.Second, 20*time.Millisecond)
}

// TestJWTBlocked: blocking the mapped user (a block event applied to the
// catalog, as for keys) refuses its tokens at once with user_blocked.
func TestJWTBlocked(t *testing.T) {
	t.Parallel()
	e := newJWTEnv(t, authn.JWKSConfig{}, nil)
	tok := e.is.Sign(good(nil))
	_, oe := e.check(tok)
	require.Nil(t, oe)
	for _, tc := range []struct{ typ, id, code string }{{"user", "u1", "user_blocked"}, {"team", "t1", "team_blocked"}, {"org", "o1", "org_blocked"}} {
		cat, err := e.cat.Apply(&configv1.Event{Seq: 1, Change: &configv1.Event_Block{Block: &configv1.BlockChange{ObjectType: tc.typ, Id: tc.id, Blocked: true}}}, 1)
		require.NoError(t, err)
		prev := e.cat
		e.cat = cat
		_, oe = e.check(tok)
		require.NotNil(t, oe)
		require.Equal(t, http.StatusForbidden, oe.Status)
		require.Equal(t, tc.code, oe.Code)
		e.cat = prev
	}
	// The issuer deleted: its tokens are refused.
	cat, err := e.cat.Apply(&configv1.Event{Seq: 1, Change: &configv1.Event_TrustedIssuerDeleted{TrustedIssuerDeleted: "iss1"}}, 1)
	require.NoError(t, err)
	e.cat = cat
	_, oe = e.check(tok)
	require.Equal(t, openai.CodeUntrustedIssuer, oe.Code)
}

func TestClaimString(t *testing.T) {
	t.Parallel()
	claims := map[string]any{"a": map[string]any{"b": "x", "n": float64(42)}, "s": "top", "arr": []any{"x"}}
	for _, tc := range []struct {
		path, want string
		ok         bool
	}{{"a.b", "x", true}, {"a.n", "42", true}, {"s", "top", true}, {"missing", "", true}, {"a.missing", "", true},
		{"s.deeper", "", false}, {"arr", "", false}, {"a", "", false}} {
		got, ok := authn.ClaimString(claims, tc.path)
		require.Equal(t, tc.ok, ok, tc.path)
		require.Equal(t, tc.want, got, tc.path)
	}
}
