package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/internal/oidctest"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestJWTThroughProxy: a token of the org's trusted issuer reaches the
// upstream and its usage is charged to the mapped team, user and end
// customer; keys keep working beside it; a bad token is a typed 401 in
// the OpenAI shape, recorded as a pre-auth refusal.
func TestJWTThroughProxy(t *testing.T) {
	t.Parallel()
	sim := startSim(t, nil)
	is := oidctest.Start(t)
	jwks, err := authn.NewJWKS(authn.JWKSConfig{})
	require.NoError(t, err)
	e := newEnv(t, func(c *Config) { c.JWT = &authn.JWT{Keys: jwks} })
	e.snap.Teams[0].Name = "research"
	e.snap.Users[0].Email = "ada@example.com"
	e.snap.TrustedIssuers = []*configv1.TrustedIssuer{{Id: "iss1", OrgId: "o1", Issuer: is.URL(), Audience: "sluice",
		JwksUrl: is.JWKSURL(), TeamClaim: "groups.primary", UserClaim: "email", CustomerClaim: "tenant",
		UnknownPolicy: configv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE}}
	keyTok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", sim.URL()+"/v1", nil)
	e.apply()

	tok := is.Sign(oidctest.Claims{Subject: "s1", Audience: "sluice", Extra: map[string]any{
		"groups": map[string]any{"primary": "research"}, "email": "ada@example.com", "tenant": "acme"}})
	resp := e.post(RouteChat, tok, chatBody("g", ""), oai.HeaderEndUser, "spoofed")
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	var out struct {
		Usage struct {
			Total int64 `json:"total_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(b, &out))
	ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
	require.Equal(t, "o1", ev.OrgId)
	require.Equal(t, "t1", ev.TeamId)
	require.Equal(t, "u1", ev.UserId)
	require.Equal(t, "jwt:iss1", ev.KeyId)
	require.Equal(t, "acme", ev.Customer, "the customer claim wins over the header")
	require.Equal(t, out.Usage.Total, ev.PromptTokens+ev.CompletionTokens)
	require.Positive(t, ev.CostUsd)

	resp = e.post(RouteChat, keyTok, chatBody("g", ""))
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "keys beside JWTs")

	wrong := is.Sign(oidctest.Claims{Subject: "s1", Audience: "other", Extra: map[string]any{"email": "ada@example.com"}})
	ae := readErr(t, e.post(RouteChat, wrong, chatBody("g", "")))
	require.Equal(t, http.StatusUnauthorized, ae.Status)
	require.Equal(t, oai.CodeInvalidAudience, ae.Error.Code)
	require.Equal(t, oai.TypeInvalidRequest, ae.Error.Type)
	ae = readErr(t, e.post(RouteChat, is.Unsigned(oidctest.Claims{Audience: "sluice"}), chatBody("g", "")))
	require.Equal(t, oai.CodeInvalidToken, ae.Error.Code)
}
