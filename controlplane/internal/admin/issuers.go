package admin

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strings"
	"unicode"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// issuerService implements IssuerService: the JWT/OIDC issuers an org
// trusts on the data plane (docs/jwt.md).
type issuerService struct{ *Server }

const (
	maxIssuerURLLen = 2000
	maxAudienceLen  = 500
	maxClaimLen     = 200

	policyRefuse      = "refuse"
	policyDefaultTeam = "default_team"
)

func issuerToProto(ti store.TrustedIssuer) *adminv1.TrustedIssuer {
	policy := adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE
	if ti.UnknownPolicy == policyDefaultTeam {
		policy = adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_DEFAULT_TEAM
	}
	return &adminv1.TrustedIssuer{Id: ti.ID, OrgId: ti.OrgID, Issuer: ti.Issuer, Audience: ti.Audience, JwksUrl: ti.JWKSURL,
		TeamClaim: ti.TeamClaim, UserClaim: ti.UserClaim, CustomerClaim: ti.CustomerClaim, UnknownPolicy: policy,
		DefaultTeamId: ti.DefaultTeamID, CreateTime: timestamppb.New(ti.CreatedAt), ProjectClaim: ti.ProjectClaim, TagsClaim: ti.TagsClaim}
}

// validateIssuerURL: an absolute https URL without query or fragment;
// http only on a loopback host (tests, a sidecar issuer).
func validateIssuerURL(c *validator, field, s string, required bool) {
	if s == "" {
		if required {
			c.add(field, "required")
		}
		return
	}
	u, err := url.Parse(s)
	switch {
	case len(s) > maxIssuerURLLen:
		c.add(field, "must be at most %d characters", maxIssuerURLLen)
	case err != nil || u.Host == "" || u.User != nil:
		c.add(field, "must be an absolute URL without user info")
	case u.RawQuery != "" || u.Fragment != "":
		c.add(field, "must not have a query or fragment")
	case u.Scheme == "https":
	case u.Scheme == "http" && isLoopback(u.Hostname()):
	default:
		c.add(field, "must be an https URL (http only on a loopback host)")
	}
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// validateClaim: a dot path of non-empty segments of printable
// characters without spaces.
func validateClaim(c *validator, field, s string) {
	if s == "" {
		return
	}
	if len(s) > maxClaimLen {
		c.add(field, "must be at most %d characters", maxClaimLen)
		return
	}
	for seg := range strings.SplitSeq(s, ".") {
		if seg == "" || strings.IndexFunc(seg, func(r rune) bool { return !unicode.IsPrint(r) || unicode.IsSpace(r) }) >= 0 {
			c.add(field, "must be a dot path of non-empty names without spaces (e.g. \"groups.primary\")")
			return
		}
	}
}

func (s *issuerService) CreateTrustedIssuer(ctx context.Context, req *connect.Request[adminv1.CreateTrustedIssuerRequest]) (*connect.Response[adminv1.CreateTrustedIssuerResponse], error) {
	m := req.Msg
	orgID, err := createTenant(ctx, m.GetOrgId(), "trusted issuers")
	if err != nil {
		return nil, err
	}
	c := &validator{}
	validateIssuerURL(c, "issuer", m.GetIssuer(), true)
	validateIssuerURL(c, "jwks_url", m.GetJwksUrl(), false)
	switch a := m.GetAudience(); {
	case a == "":
		c.add("audience", "required")
	case len(a) > maxAudienceLen || strings.TrimSpace(a) != a || strings.IndexFunc(a, unicode.IsControl) >= 0:
		c.add("audience", "must be 1–%d characters without surrounding spaces or control characters", maxAudienceLen)
	}
	validateClaim(c, "team_claim", m.GetTeamClaim())
	validateClaim(c, "user_claim", m.GetUserClaim())
	validateClaim(c, "customer_claim", m.GetCustomerClaim())
	validateClaim(c, "project_claim", m.GetProjectClaim())
	validateClaim(c, "tags_claim", m.GetTagsClaim())
	policy := policyRefuse
	switch m.GetUnknownPolicy() {
	case adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_UNSPECIFIED, adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE:
	case adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_DEFAULT_TEAM:
		policy = policyDefaultTeam
	default:
		c.add("unknown_policy", "unknown value %d", m.GetUnknownPolicy())
	}
	needsDefault := policy == policyDefaultTeam || m.GetTeamClaim() == ""
	switch {
	case needsDefault && m.GetDefaultTeamId() == "":
		c.add("default_team_id", "required with the default_team policy or without a team_claim")
	case !needsDefault && m.GetDefaultTeamId() != "":
		c.add("default_team_id", "is used only with the default_team policy or without a team_claim (it would be ignored)")
	}
	if err := c.err(); err != nil {
		return nil, err
	}
	if id := m.GetDefaultTeamId(); id != "" {
		t, err := s.store.TeamGet(ctx, store.Tenant{OrgID: orgID}, id)
		if errors.Is(err, store.ErrNotFound) || (err == nil && t.OrgID != orgID) {
			return nil, invalid("default_team_id", "no team %s in org %s", id, orgID)
		}
		if err != nil {
			return nil, err
		}
	}
	ti := store.TrustedIssuer{ID: ids.New(ids.Issuer), OrgID: orgID, Issuer: m.GetIssuer(), Audience: m.GetAudience(),
		JWKSURL: m.GetJwksUrl(), TeamClaim: m.GetTeamClaim(), UserClaim: m.GetUserClaim(), CustomerClaim: m.GetCustomerClaim(),
		ProjectClaim: m.GetProjectClaim(), TagsClaim: m.GetTagsClaim(), UnknownPolicy: policy, DefaultTeamID: m.GetDefaultTeamId()}
	out, err := createObject(ctx, s.store, issuerObjects, &ti, func(tx *store.Tx) error { return tx.TrustedIssuerInsert(ctx, &ti) })
	return reply(&adminv1.CreateTrustedIssuerResponse{Issuer: out}, err)
}

func (s *issuerService) GetTrustedIssuer(ctx context.Context, req *connect.Request[adminv1.GetTrustedIssuerRequest]) (*connect.Response[adminv1.GetTrustedIssuerResponse], error) {
	id := req.Msg.GetId()
	if err := orgObjectGate(ctx, authz.Read, "trusted issuers", "id", id); err != nil {
		return nil, err
	}
	out, err := getObject(ctx, s.store, issuerObjects, id)
	return reply(&adminv1.GetTrustedIssuerResponse{Issuer: out}, err)
}

func (s *issuerService) ListTrustedIssuers(ctx context.Context, req *connect.Request[adminv1.ListTrustedIssuersRequest]) (*connect.Response[adminv1.ListTrustedIssuersResponse], error) {
	m := req.Msg
	t, err := listTenant(ctx, m.GetOrgId(), "trusted issuers")
	if err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.TrustedIssuerList(ctx, t, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListTrustedIssuersResponse{}
	resp.Issuers, resp.NextPageToken, err = page(rows, limit, infallible(issuerToProto), func(ti store.TrustedIssuer) string { return ti.ID })
	return reply(resp, err)
}

func (s *issuerService) DeleteTrustedIssuer(ctx context.Context, req *connect.Request[adminv1.DeleteTrustedIssuerRequest]) (*connect.Response[adminv1.DeleteTrustedIssuerResponse], error) {
	return reply(&adminv1.DeleteTrustedIssuerResponse{}, deleteObject(ctx, s.store, issuerObjects, req.Msg.GetId()))
}

// issuerObjects is the object of Create/DeleteTrustedIssuer (issuers are not
// blocked: delete one to stop its tokens).
var issuerObjects = mutable[store.TrustedIssuer, *adminv1.TrustedIssuer]{
	object: events.ObjTrustedIssuer,
	gate: func(ctx context.Context, field, id string) error {
		return orgObjectGate(ctx, authz.Write, "trusted issuers", field, id)
	},
	get:          (*store.Store).TrustedIssuerGet,
	getForUpdate: (*store.Tx).TrustedIssuerGetForUpdate,
	target:       func(v store.TrustedIssuer) authz.Target { return authz.OrgTarget(v.OrgID, "trusted issuer "+v.ID) },
	remove: func(ctx context.Context, tx *store.Tx, cur store.TrustedIssuer) (any, error) {
		return nil, tx.TrustedIssuerDelete(ctx, cur.ID)
	},
	toProto: infallible(issuerToProto),
	scope:   func(ti store.TrustedIssuer) (string, string, string) { return ti.ID, ti.OrgID, "" },
}
