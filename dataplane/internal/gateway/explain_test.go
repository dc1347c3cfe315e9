package gateway

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestExplainScopesAndRecordsNothing: a credential outside the caller's
// scope (or unknown, for a scoped caller) is not found; the platform sees
// why an unknown token is refused; malformed queries are invalid; and
// explaining records no usage event.
func TestExplainScopesAndRecordsNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tok := e.key("k1", nil)
	e.group("g")
	e.deploy("d1", "g", "http://127.0.0.1:1/v1", nil)
	e.apply()
	ctx := context.Background()
	q := func(edit func(*configv1.ExplainQuery)) *configv1.ExplainQuery {
		out := &configv1.ExplainQuery{Model: "g"}
		edit(out)
		return out
	}
	tr, err := e.h.Explain(ctx, ExplainScope{OrgID: "o1", TeamID: "t1"}, q(func(q *configv1.ExplainQuery) { q.Token = tok }))
	require.NoError(t, err)
	require.Equal(t, int32(http.StatusOK), tr.GetOutcome().GetStatus())
	require.Equal(t, []string{"d1"}, tr.GetRouting().GetOrder())
	require.Equal(t, "k1", tr.GetAuth().GetKeyId())
	for _, sc := range []ExplainScope{{OrgID: "o2"}, {OrgID: "o1", TeamID: "t2"}} {
		_, err := e.h.Explain(ctx, sc, q(func(q *configv1.ExplainQuery) { q.KeyId = "k1" }))
		require.ErrorIs(t, err, ErrExplainNotFound, "%+v", sc)
	}
	_, err = e.h.Explain(ctx, ExplainScope{}, q(func(q *configv1.ExplainQuery) { q.KeyId = "nope" }))
	require.ErrorIs(t, err, ErrExplainNotFound)
	_, err = e.h.Explain(ctx, ExplainScope{OrgID: "o1"}, q(func(q *configv1.ExplainQuery) { q.Token = "sk-sluice-unknown" }))
	require.ErrorIs(t, err, ErrExplainNotFound)
	tr, err = e.h.Explain(ctx, ExplainScope{}, q(func(q *configv1.ExplainQuery) { q.Token = "sk-sluice-unknown" }))
	require.NoError(t, err)
	require.Equal(t, oai.CodeInvalidAPIKey, tr.GetOutcome().GetErrorCode())
	require.Equal(t, "authenticate", tr.GetOutcome().GetStage())
	for _, bad := range []*configv1.ExplainQuery{
		q(func(q *configv1.ExplainQuery) {}),
		q(func(q *configv1.ExplainQuery) { q.KeyId, q.Token = "k1", tok }),
		q(func(q *configv1.ExplainQuery) { q.KeyId, q.Headers = "k1", map[string]string{"x-api-key": tok} }),
		q(func(q *configv1.ExplainQuery) { q.KeyId, q.Route = "k1", "/v1/nope" }),
		q(func(q *configv1.ExplainQuery) { q.KeyId, q.Body = "k1", []byte(`{}`) }),
	} {
		_, err := e.h.Explain(ctx, ExplainScope{}, bad)
		require.ErrorIs(t, err, ErrExplainInvalid, "%v", bad)
	}
	tr, err = e.h.Explain(ctx, ExplainScope{}, q(func(q *configv1.ExplainQuery) { q.KeyId, q.PromptBytes = "k1", DefaultMaxBodyBytes+1 }))
	require.NoError(t, err)
	require.Equal(t, oai.CodeRequestTooLarge, tr.GetOutcome().GetErrorCode())
	require.Empty(t, e.sink.events(), "explaining records no usage event")
}

// TestExplainJWTClaims maps synthetic claims of a trusted issuer as a
// verified token's would be, and keeps issuers of other orgs out of reach.
func TestExplainJWTClaims(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.snap.Teams[0].Name = "research"
	e.snap.Users[0].Email = "ada@example.com"
	e.snap.TrustedIssuers = []*configv1.TrustedIssuer{{Id: "iss1", OrgId: "o1", Issuer: "https://idp.example.com", Audience: "sluice",
		JwksUrl: "https://idp.example.com/jwks", TeamClaim: "groups.primary", UserClaim: "email", CustomerClaim: "tenant",
		UnknownPolicy: configv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE}}
	e.group("g")
	e.deploy("d1", "g", "http://127.0.0.1:1/v1", nil)
	e.apply()
	claims := func(m map[string]any) *configv1.ExplainQuery {
		s, err := structpb.NewStruct(m)
		require.NoError(t, err)
		return &configv1.ExplainQuery{Model: "g", Jwt: &configv1.ExplainJWTClaims{Issuer: "https://idp.example.com", Audience: "sluice", Subject: "s1", Claims: s}}
	}
	ctx := context.Background()
	tr, err := e.h.Explain(ctx, ExplainScope{OrgID: "o1"}, claims(map[string]any{
		"groups": map[string]any{"primary": "research"}, "email": "ada@example.com", "tenant": "acme"}))
	require.NoError(t, err)
	require.Equal(t, int32(http.StatusOK), tr.GetOutcome().GetStatus(), "%v", tr.GetOutcome())
	a := tr.GetAuth()
	require.Equal(t, "jwt_claims", a.GetMethod())
	require.Equal(t, "jwt:iss1", a.GetKeyId())
	require.Equal(t, "t1", a.GetTeamId())
	require.Equal(t, "u1", a.GetUserId())
	require.Equal(t, "acme", a.GetCustomer())

	tr, err = e.h.Explain(ctx, ExplainScope{OrgID: "o1"}, claims(map[string]any{"groups": map[string]any{"primary": "nobody"}, "email": "ada@example.com"}))
	require.NoError(t, err)
	require.Equal(t, oai.CodeUnknownIdentity, tr.GetOutcome().GetErrorCode())

	_, err = e.h.Explain(ctx, ExplainScope{OrgID: "o2"}, claims(map[string]any{"email": "ada@example.com"}))
	require.ErrorIs(t, err, ErrExplainNotFound, "another org's issuer")
	q := claims(map[string]any{})
	q.Jwt.Audience = "other"
	_, err = e.h.Explain(ctx, ExplainScope{}, q)
	require.ErrorIs(t, err, ErrExplainNotFound, "no issuer for that audience")
}
