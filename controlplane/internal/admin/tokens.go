package admin

import (
	"context"
	"errors"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	"github.com/sluicegw/sluice/internal/token"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// adminTokenService implements AdminTokenService.
type adminTokenService struct{ *Server }

const objAdminToken = "admin_token"

// enumPairs pairs the values of a Go enum (A) with those of its admin API
// enum (B); a value without a pair maps to B's zero (UNSPECIFIED) and
// back to not ok.
type enumPairs[A, B comparable] []struct {
	a A
	b B
}

func (ps enumPairs[A, B]) toProto(a A) B {
	for _, p := range ps {
		if p.a == a {
			return p.b
		}
	}
	var unspecified B
	return unspecified
}

func (ps enumPairs[A, B]) fromProto(b B) (A, bool) {
	for _, p := range ps {
		if p.b == b {
			return p.a, true
		}
	}
	var none A
	return none, false
}

var (
	scopes = enumPairs[authz.Scope, adminv1.Scope]{
		{authz.ScopePlatform, adminv1.Scope_SCOPE_PLATFORM},
		{authz.ScopeOrg, adminv1.Scope_SCOPE_ORG},
		{authz.ScopeTeam, adminv1.Scope_SCOPE_TEAM},
	}
	roles = enumPairs[authz.Role, adminv1.Role]{
		{authz.RoleViewer, adminv1.Role_ROLE_VIEWER},
		{authz.RoleEditor, adminv1.Role_ROLE_EDITOR},
		{authz.RoleAdmin, adminv1.Role_ROLE_ADMIN},
	}
)

func scopeToProto(s authz.Scope) adminv1.Scope           { return scopes.toProto(s) }
func scopeFromProto(s adminv1.Scope) (authz.Scope, bool) { return scopes.fromProto(s) }
func roleToProto(r authz.Role) adminv1.Role              { return roles.toProto(r) }
func roleFromProto(r adminv1.Role) (authz.Role, bool)    { return roles.fromProto(r) }

func adminTokenToProto(a store.AdminToken) *adminv1.AdminToken {
	out := &adminv1.AdminToken{
		Id: a.ID, Name: a.Name, Scope: scopeToProto(a.Scope), OrgId: a.OrgID, TeamId: a.TeamID,
		Role: roleToProto(a.Role), DisplayPrefix: a.DisplayPrefix, Last4: a.Last4,
		CreateTime: timestamppb.New(a.CreatedAt), CreatedBy: a.CreatedBy,
	}
	if a.ExpiresAt != nil {
		out.ExpireTime = timestamppb.New(*a.ExpiresAt)
	}
	if a.RevokedAt != nil {
		out.RevokeTime = timestamppb.New(*a.RevokedAt)
	}
	if a.PreviousValidUntil != nil {
		out.PreviousValidUntil = timestamppb.New(*a.PreviousValidUntil)
	}
	if a.RotatedAt != nil {
		out.RotateTime = timestamppb.New(*a.RotatedAt)
	}
	return out
}

// tokenTarget is the authz target of a token of the given scope.
func tokenTarget(scope authz.Scope, orgID, teamID, what string) authz.Target {
	switch scope {
	case authz.ScopeOrg:
		return authz.OrgTarget(orgID, what)
	case authz.ScopeTeam:
		return authz.TeamTarget(orgID, teamID, what)
	}
	return authz.PlatformTarget(what)
}

func (s *adminTokenService) CreateAdminToken(ctx context.Context, req *connect.Request[adminv1.CreateAdminTokenRequest]) (*connect.Response[adminv1.CreateAdminTokenResponse], error) {
	m := req.Msg
	p := principal(ctx)
	c := &validator{}
	validateName(c, "name", m.GetName(), 100)
	scope, ok := scopeFromProto(m.GetScope())
	if !ok {
		c.add("scope", "required: SCOPE_PLATFORM, SCOPE_ORG or SCOPE_TEAM")
	}
	role, ok := roleFromProto(m.GetRole())
	if !ok {
		c.add("role", "required: ROLE_VIEWER, ROLE_EDITOR or ROLE_ADMIN")
	}
	orgID, teamID := m.GetOrgId(), m.GetTeamId()
	if orgID == "" && scope != authz.ScopePlatform {
		orgID = p.OrgID // default to the caller's org
	}
	if teamID == "" && scope == authz.ScopeTeam {
		teamID = p.TeamID
	}
	switch scope {
	case authz.ScopePlatform:
		if orgID != "" || teamID != "" {
			c.add("org_id", "must be empty for SCOPE_PLATFORM")
		}
	case authz.ScopeOrg:
		if orgID == "" {
			c.add("org_id", "required for SCOPE_ORG")
		}
		if teamID != "" {
			c.add("team_id", "must be empty for SCOPE_ORG")
		}
	case authz.ScopeTeam:
		if orgID == "" {
			c.add("org_id", "required for SCOPE_TEAM")
		}
		if teamID == "" {
			c.add("team_id", "required for SCOPE_TEAM")
		}
	}
	// A token lives no longer than the token that mints it (whose
	// Expires is already the earliest expiry along its own issuers): an
	// unset expire_time inherits it, a later one is refused. Revoking or
	// expiring an issuer ends its tokens too (see principalFromChain).
	var expires *timestampAt
	if m.ExpireTime != nil {
		if err := m.ExpireTime.CheckValid(); err != nil {
			c.add("expire_time", "invalid timestamp")
		} else if !m.ExpireTime.AsTime().After(s.store.Now()) {
			c.add("expire_time", "must be in the future")
		} else if t := m.ExpireTime.AsTime().UTC().Truncate(time.Microsecond); !p.Expires.IsZero() && t.After(p.Expires) {
			c.add("expire_time", "must not be after the expiry of the token creating it (%s); leave it unset to inherit that expiry",
				p.Expires.UTC().Format(time.RFC3339Nano))
		} else {
			expires = &timestampAt{t}
		}
	} else if !p.Expires.IsZero() {
		expires = &timestampAt{p.Expires.UTC()}
	}
	if err := c.err(); err != nil {
		// Authorise first so that an unauthorised caller learns nothing
		// from validation; a denied caller gets PermissionDenied.
		if aerr := authz.Check(ctx, p, authz.ManageTokens, tokenTarget(scope, orgID, teamID, "admin tokens")); aerr != nil {
			return nil, aerr
		}
		return nil, err
	}
	if err := authz.CanGrant(ctx, p, scope, orgID, teamID, role); err != nil {
		return nil, err
	}
	raw := token.Generate(token.AdminPrefix)
	hash, ver := s.peppers.HashCurrent(raw)
	nt := store.NewAdminToken{
		AdminToken: store.AdminToken{
			ID: ids.New(ids.AdminToken), Name: m.GetName(), Scope: scope, OrgID: orgID, TeamID: teamID, Role: role,
			DisplayPrefix: token.DisplayPrefix(token.AdminPrefix, raw), Last4: token.Last4(raw), CreatedBy: p.ID,
		},
		Hash: hash, PepperVersion: ver,
	}
	if expires != nil {
		nt.ExpiresAt = &expires.t
	}
	var out *adminv1.AdminToken
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		// Foreign keys check that the org exists and the team is in it.
		if err := tx.AdminTokenInsert(ctx, &nt); err != nil {
			return err
		}
		out = adminTokenToProto(nt.AdminToken)
		return tx.Audit(ctx, audit.ActionTokenCreated, objAdminToken, nt.ID, orgID, teamID, nil, auditJSON(out))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.CreateAdminTokenResponse{AdminToken: out, Token: raw}), nil
}

type timestampAt struct{ t time.Time }

func (s *adminTokenService) ListAdminTokens(ctx context.Context, req *connect.Request[adminv1.ListAdminTokensRequest]) (*connect.Response[adminv1.ListAdminTokensResponse], error) {
	p := principal(ctx)
	t := tenant(ctx)
	if req.Msg.GetOrgId() != "" {
		if t.OrgID != "" && t.OrgID != req.Msg.GetOrgId() {
			return nil, authz.Check(ctx, p, authz.ManageTokens, authz.OrgTarget(req.Msg.GetOrgId(), "admin tokens of org "+req.Msg.GetOrgId()))
		}
		t.OrgID = req.Msg.GetOrgId()
	}
	if req.Msg.GetTeamId() != "" {
		if t.TeamID != "" && t.TeamID != req.Msg.GetTeamId() {
			return nil, authz.Check(ctx, p, authz.ManageTokens, authz.TeamTarget(t.OrgID, req.Msg.GetTeamId(), "admin tokens of team "+req.Msg.GetTeamId()))
		}
		t.TeamID = req.Msg.GetTeamId()
	}
	if err := authz.Check(ctx, p, authz.ManageTokens, tokenTarget(p.Scope, p.OrgID, p.TeamID, "admin tokens")); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.AdminTokenList(ctx, t, req.Msg.GetIncludeRevoked(), store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListAdminTokensResponse{}
	resp.AdminTokens, resp.NextPageToken, err = page(rows, limit, infallible(adminTokenToProto), func(a store.AdminToken) string { return a.ID })
	return reply(resp, err)
}

func (s *adminTokenService) RevokeAdminToken(ctx context.Context, req *connect.Request[adminv1.RevokeAdminTokenRequest]) (*connect.Response[adminv1.RevokeAdminTokenResponse], error) {
	var out *adminv1.AdminToken
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.AdminTokenGetForUpdate(ctx, tenant(ctx), req.Msg.GetId())
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.ManageTokens, tokenTarget(cur.Scope, cur.OrgID, cur.TeamID, "admin token "+cur.ID)); err != nil {
			return err
		}
		if cur.RevokedAt != nil {
			return &store.Error{Code: store.ErrFailedPrecondition, Msg: "admin token " + cur.ID + " is already revoked"}
		}
		before := adminTokenToProto(cur)
		if err := tx.AdminTokenRevoke(ctx, &cur); err != nil {
			return err
		}
		out = adminTokenToProto(cur)
		return tx.Audit(ctx, audit.ActionTokenRevoked, objAdminToken, cur.ID, cur.OrgID, cur.TeamID, auditJSON(before), auditJSON(out))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.RevokeAdminTokenResponse{AdminToken: out}), nil
}

// DeleteAdminToken deletes a token's record: it is refused from the next
// request on, and so is every token it created (their issuer chain is
// broken). Deleting the token that authenticates the call is allowed.
func (s *adminTokenService) DeleteAdminToken(ctx context.Context, req *connect.Request[adminv1.DeleteAdminTokenRequest]) (*connect.Response[adminv1.DeleteAdminTokenResponse], error) {
	if err := requireID("id", req.Msg.GetId()); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.AdminTokenGetForUpdate(ctx, tenant(ctx), req.Msg.GetId())
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.ManageTokens, tokenTarget(cur.Scope, cur.OrgID, cur.TeamID, "admin token "+cur.ID)); err != nil {
			return err
		}
		if err := tx.AdminTokenDelete(ctx, cur.ID); err != nil {
			return err
		}
		return tx.Audit(ctx, audit.ActionDeleted, objAdminToken, cur.ID, cur.OrgID, cur.TeamID, auditJSON(adminTokenToProto(cur)), nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteAdminTokenResponse{}), nil
}

// RotateAdminToken gives a token a new secret on the same record: its id,
// scope, role, expiry and the tokens it created are unchanged. With a
// grace period the previous secret keeps working until it ends (one
// previous secret at a time: rotating again drops the older one).
func (s *adminTokenService) RotateAdminToken(ctx context.Context, req *connect.Request[adminv1.RotateAdminTokenRequest]) (*connect.Response[adminv1.RotateAdminTokenResponse], error) {
	if err := requireID("id", req.Msg.GetId()); err != nil {
		return nil, err
	}
	grace, err := parseGracePeriod(req.Msg.GetGracePeriod())
	if err != nil {
		return nil, err
	}
	raw := token.Generate(token.AdminPrefix)
	hash, ver := s.peppers.HashCurrent(raw)
	var out *adminv1.AdminToken
	err = s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.AdminTokenGetForUpdate(ctx, tenant(ctx), req.Msg.GetId())
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.ManageTokens, tokenTarget(cur.Scope, cur.OrgID, cur.TeamID, "admin token "+cur.ID)); err != nil {
			return err
		}
		if cur.RevokedAt != nil {
			return &store.Error{Code: store.ErrFailedPrecondition, Msg: "admin token " + cur.ID + " is revoked; create a new one"}
		}
		oldHash, oldVer, err := tx.AdminTokenHash(ctx, cur.ID)
		if err != nil {
			return err
		}
		before := adminTokenToProto(cur)
		var until *time.Time
		if grace > 0 {
			u := tx.Now().Add(grace).Truncate(time.Microsecond)
			until = &u
		}
		cur.DisplayPrefix, cur.Last4 = token.DisplayPrefix(token.AdminPrefix, raw), token.Last4(raw)
		if err := tx.AdminTokenRotate(ctx, &cur, hash, ver, oldHash, oldVer, until); err != nil {
			return err
		}
		out = adminTokenToProto(cur)
		after, err := rotationAfter(out, grace, until)
		if err != nil {
			return err
		}
		return tx.Audit(ctx, audit.ActionRotated, objAdminToken, cur.ID, cur.OrgID, cur.TeamID, auditJSON(before), after)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.RotateAdminTokenResponse{AdminToken: out, Token: raw}), nil
}

// UpdateAdminTokenExpiry sets or clears a token's expiry. Like a new
// token, it may not outlive the caller (whose expiry is the earliest
// along its issuers); an expiry in the past is refused.
func (s *adminTokenService) UpdateAdminTokenExpiry(ctx context.Context, req *connect.Request[adminv1.UpdateAdminTokenExpiryRequest]) (*connect.Response[adminv1.UpdateAdminTokenExpiryResponse], error) {
	if err := requireID("id", req.Msg.GetId()); err != nil {
		return nil, err
	}
	p := principal(ctx)
	var out *adminv1.AdminToken
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.AdminTokenGetForUpdate(ctx, tenant(ctx), req.Msg.GetId())
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, p, authz.ManageTokens, tokenTarget(cur.Scope, cur.OrgID, cur.TeamID, "admin token "+cur.ID)); err != nil {
			return err
		}
		if cur.RevokedAt != nil {
			return &store.Error{Code: store.ErrFailedPrecondition, Msg: "admin token " + cur.ID + " is revoked"}
		}
		var expires *time.Time
		if et := req.Msg.GetExpireTime(); et != nil {
			if err := et.CheckValid(); err != nil {
				return invalid("expire_time", "invalid timestamp")
			}
			t := et.AsTime().UTC().Truncate(time.Microsecond)
			switch {
			case !t.After(tx.Now()):
				return invalid("expire_time", "must be in the future (revoke or delete the token to end it now)")
			case !p.Expires.IsZero() && t.After(p.Expires):
				return invalid("expire_time", "must not be after the expiry of the calling token (%s)", p.Expires.UTC().Format(time.RFC3339Nano))
			}
			expires = &t
		} else if !p.Expires.IsZero() {
			return invalid("expire_time", "required: the calling token expires (%s), so it cannot make a token that never does", p.Expires.UTC().Format(time.RFC3339Nano))
		}
		before := adminTokenToProto(cur)
		if err := tx.AdminTokenSetExpiry(ctx, &cur, expires); err != nil {
			return err
		}
		out = adminTokenToProto(cur)
		return tx.Audit(ctx, audit.ActionUpdated, objAdminToken, cur.ID, cur.OrgID, cur.TeamID, auditJSON(before), auditJSON(out))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpdateAdminTokenExpiryResponse{AdminToken: out}), nil
}

func (s *adminTokenService) WhoAmI(ctx context.Context, _ *connect.Request[adminv1.WhoAmIRequest]) (*connect.Response[adminv1.WhoAmIResponse], error) {
	p := principal(ctx)
	if p == nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("no principal"))
	}
	authz.MarkChecked(ctx) // describes the caller only
	out := &adminv1.WhoAmIResponse{
		Principal: p.ID, Name: p.Name, Scope: scopeToProto(p.Scope), OrgId: p.OrgID, TeamId: p.TeamID, Role: roleToProto(p.Role),
	}
	if !p.Expires.IsZero() {
		out.ExpireTime = timestamppb.New(p.Expires)
	}
	return connect.NewResponse(out), nil
}
