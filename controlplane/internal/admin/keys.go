package admin

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	"github.com/sluicegw/sluice/internal/token"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// keyService implements KeyService. Keys with a team are team-level
// objects (team-scoped tokens manage them); keys without one are
// org-level objects, out of reach of team-scoped tokens.
type keyService struct{ *Server }

const objKey = string(events.ObjKey)

// keyUpdatable lists the update_mask paths of UpdateKey; the org and team
// of a key never change.
var keyUpdatable = []string{
	"alias", "project", "user_id", "expire_time", "tags", "traffic_class",
	"model_group_aliases", "enforced_params", "allowed_routes", "limits", "metadata", "fallbacks",
}

// Key field bounds.
const (
	maxKeyLabelLen      = 100 // alias, project (and project scope names)
	maxKeyTags          = 64
	maxKeyTagLen        = 64
	maxEnforcedParams   = 32
	maxEnforcedParamLen = 200
	maxRefIDLen         = 100 // team_id, user_id: longer cannot be an id
	// maxGracePeriod bounds RotateKey's grace_period: a leaked token should
	// not outlive its rotation by more than a month.
	maxGracePeriod = 30 * 24 * time.Hour
)

// keyRoutes are the proxy routes allowed_routes may name (SPEC §7).
var keyRoutes = []string{"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"}

var (
	tagPattern = regexp.MustCompile(`^[A-Za-z0-9_.:/-]{1,64}$`)
	// enforcedParamPattern is a dotted path of identifiers into the request
	// body ("user", "metadata.generation_name").
	enforcedParamPattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$`)
	graceDaysPattern     = regexp.MustCompile(`^([0-9]{1,4})d$`)
)

func keyToProto(k store.Key) (*adminv1.Key, error) {
	l, err := limitsFromJSON(k.Limits)
	if err != nil {
		return nil, err
	}
	tc, err := trafficClassFromDB(k.TrafficClass)
	if err != nil {
		return nil, err
	}
	out := &adminv1.Key{
		Id: k.ID, OrgId: k.OrgID, TeamId: k.TeamID, UserId: k.UserID, Project: k.Project, Alias: k.Alias,
		DisplayPrefix: k.DisplayPrefix, Last4: k.Last4, Tags: k.Tags, TrafficClass: tc,
		ModelGroupAliases: k.ModelGroupAliases, EnforcedParams: k.EnforcedParams, AllowedRoutes: k.AllowedRoutes,
		Limits: l, Blocked: k.Blocked, Metadata: k.Metadata, RotationCount: k.RotationCount, Fallbacks: fallbacksToProto(k.Fallbacks),
		CreateTime: timestamppb.New(k.CreatedAt), UpdateTime: timestamppb.New(k.UpdatedAt),
	}
	if k.ExpiresAt != nil {
		out.ExpireTime = timestamppb.New(*k.ExpiresAt)
	}
	if k.RotatedAt != nil {
		out.RotateTime = timestamppb.New(*k.RotatedAt)
	}
	return out, nil
}

// keySettings copies the settable fields of k into sk (the store form).
func keySettings(sk *store.Key, k *adminv1.Key) {
	sk.UserID, sk.Project, sk.Alias = k.GetUserId(), k.GetProject(), k.GetAlias()
	sk.ExpiresAt = nil
	if k.GetExpireTime() != nil {
		t := k.GetExpireTime().AsTime().UTC().Truncate(time.Microsecond) // Postgres precision
		sk.ExpiresAt = &t
	}
	sk.Tags, sk.TrafficClass = k.GetTags(), trafficClassToDB(k.GetTrafficClass())
	sk.ModelGroupAliases, sk.EnforcedParams, sk.AllowedRoutes = k.GetModelGroupAliases(), k.GetEnforcedParams(), k.GetAllowedRoutes()
	sk.Limits, sk.Metadata = limitsJSON(k.GetLimits()), k.GetMetadata()
}

// validateKey checks the settable fields of k. The expiry must lie after
// now only when it is being set (checkExpiry), so that an expired key can
// still be edited; the project is checked only when it is set or changed
// (checkProject), so that a key created before the project rule can still
// be edited in its other fields.
func validateKey(k *adminv1.Key, now time.Time, checkExpiry, checkProject bool) error {
	c := &validator{}
	validateKeyLabel(c, "alias", k.GetAlias())
	if checkProject && k.GetProject() != "" {
		// The same rule as project scopes: a key's project can be given limits.
		validateProject(c, "project", k.GetProject())
	}
	if len(k.GetUserId()) > maxRefIDLen {
		c.add("user_id", "must be at most %d characters", maxRefIDLen)
	}
	if ts := k.GetExpireTime(); ts != nil {
		if err := ts.CheckValid(); err != nil {
			c.add("expire_time", "invalid timestamp")
		} else if checkExpiry && !ts.AsTime().After(now) {
			c.add("expire_time", "must be in the future (now is %s)", now.Format(time.RFC3339))
		}
	}
	validateTags(c, "tags", k.GetTags())
	validateTrafficClass(c, "traffic_class", k.GetTrafficClass())
	validateAliases(c, "model_group_aliases", k.GetModelGroupAliases())
	validateEnforcedParams(c, "enforced_params", k.GetEnforcedParams())
	validateRoutes(c, "allowed_routes", k.GetAllowedRoutes())
	validateLimits(c, "limits", k.GetLimits(), LevelKey, nil)
	validateMetadata(c, k.GetMetadata())
	validateFallbackOverrides(c, "fallbacks", k.GetFallbacks())
	return c.err()
}

// validateKeyLabel checks an optional free-form label.
func validateKeyLabel(c *validator, field, s string) {
	if !utf8.ValidString(s) || utf8.RuneCountInString(s) > maxKeyLabelLen {
		c.add(field, "must be at most %d characters of valid UTF-8", maxKeyLabelLen)
	}
}

func validateTags(c *validator, field string, tags []string) {
	if len(tags) > maxKeyTags {
		c.add(field, "at most %d tags (got %d)", maxKeyTags, len(tags))
		return
	}
	seen := map[string]bool{}
	for i, t := range tags {
		f := fmt.Sprintf("%s[%d]", field, i)
		switch {
		case !tagPattern.MatchString(t):
			validateTag(c, f, t) // the same rule as tag scopes
		case seen[t]:
			c.add(f, "duplicate tag %q", t)
		}
		seen[t] = true
	}
}

func validateEnforcedParams(c *validator, field string, params []string) {
	if len(params) > maxEnforcedParams {
		c.add(field, "at most %d entries (got %d)", maxEnforcedParams, len(params))
		return
	}
	seen := map[string]bool{}
	for i, p := range params {
		f := fmt.Sprintf("%s[%d]", field, i)
		switch {
		case len(p) > maxEnforcedParamLen || !enforcedParamPattern.MatchString(p):
			c.add(f, "%q must be a dotted path of request body fields such as \"user\" or \"metadata.generation_name\" (at most %d characters)", p, maxEnforcedParamLen)
		case seen[p]:
			c.add(f, "duplicate parameter %q", p)
		}
		seen[p] = true
	}
}

func validateRoutes(c *validator, field string, routes []string) {
	seen := map[string]bool{}
	for i, r := range routes {
		f := fmt.Sprintf("%s[%d]", field, i)
		known := false
		for _, k := range keyRoutes {
			known = known || r == k
		}
		switch {
		case !known:
			c.add(f, "unknown route %q (routes: %s)", r, strings.Join(keyRoutes, ", "))
		case seen[r]:
			c.add(f, "duplicate route %q", r)
		}
		seen[r] = true
	}
}

// parseGracePeriod parses RotateKey's grace_period: "" or any zero
// duration means none; otherwise a Go duration ("90s", "15m", "24h") or
// whole days ("7d"), at most 30 days.
func parseGracePeriod(s string) (time.Duration, error) {
	if s == "" {
		return 0, nil
	}
	var d time.Duration
	if m := graceDaysPattern.FindStringSubmatch(s); m != nil {
		n, _ := strconv.Atoi(m[1]) // at most 4 digits: no overflow
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return 0, invalid("grace_period", "%q is not a duration: want e.g. 90s, 15m, 24h or 7d", s)
		}
	}
	switch {
	case d < 0:
		return 0, invalid("grace_period", "%q is negative", s)
	case d > maxGracePeriod:
		return 0, invalid("grace_period", "%q is too long: at most 30d", s)
	}
	return d, nil
}

// keyTarget is the authz target of key k.
func keyTarget(k store.Key) authz.Target {
	return authz.TeamTarget(k.OrgID, k.TeamID, "key "+k.ID)
}

// keyWriteGate refuses callers who may not change any key (viewers)
// before a request is validated, so they learn nothing from validation.
// The check against the key itself follows once it is loaded.
func keyWriteGate(ctx context.Context) error {
	p := principal(ctx)
	return authz.Check(ctx, p, authz.Write, authz.TeamTarget(p.OrgID, p.TeamID, "keys"))
}

// newKeySecret makes a token and what the store keeps of it.
func (s *keyService) newKeySecret() (string, store.KeySecret) {
	tok := token.Generate(token.KeyPrefix)
	hash, ver := s.peppers.HashCurrent(tok)
	return tok, store.KeySecret{
		Hash: hash, PepperVersion: ver,
		DisplayPrefix: token.DisplayPrefix(token.KeyPrefix, tok), Last4: token.Last4(tok),
	}
}

func (s *keyService) CreateKey(ctx context.Context, req *connect.Request[adminv1.CreateKeyRequest]) (*connect.Response[adminv1.CreateKeyResponse], error) {
	p := principal(ctx)
	m := req.Msg
	orgID, teamID := m.GetOrgId(), m.GetTeamId()
	if orgID == "" {
		if p.Scope == authz.ScopePlatform {
			if err := authz.Check(ctx, p, authz.Write, authz.PlatformTarget("keys")); err != nil {
				return nil, err
			}
			return nil, invalid("org_id", "required with a platform-scoped token")
		}
		orgID = p.OrgID
	}
	if teamID == "" && p.Scope == authz.ScopeTeam {
		teamID = p.TeamID
	}
	what := "keys of org " + orgID
	if teamID != "" {
		what = "keys of team " + teamID
	}
	if err := authz.Check(ctx, p, authz.Write, authz.TeamTarget(orgID, teamID, what)); err != nil {
		return nil, err
	}
	want := &adminv1.Key{
		UserId: m.GetUserId(), Project: m.GetProject(), Alias: m.GetAlias(), ExpireTime: m.GetExpireTime(),
		Tags: m.GetTags(), TrafficClass: m.GetTrafficClass(), ModelGroupAliases: m.GetModelGroupAliases(),
		EnforcedParams: m.GetEnforcedParams(), AllowedRoutes: m.GetAllowedRoutes(), Limits: m.GetLimits(),
		Metadata: m.GetMetadata(), Fallbacks: m.GetFallbacks(),
	}
	c := &validator{}
	if len(orgID) > maxRefIDLen {
		c.add("org_id", "must be at most %d characters", maxRefIDLen)
	}
	if len(teamID) > maxRefIDLen {
		c.add("team_id", "must be at most %d characters", maxRefIDLen)
	}
	if err := c.err(); err != nil {
		return nil, err
	}
	if err := validateKey(want, s.store.Now(), true, true); err != nil {
		return nil, err
	}
	k := store.Key{ID: ids.New(ids.Key), OrgID: orgID, TeamID: teamID}
	keySettings(&k, want)
	tok, sec := s.newKeySecret()
	out, err := createObject(ctx, s.store, keyObjects, &k, func(tx *store.Tx) error {
		if err := tx.KeyCheckRefs(ctx, k.OrgID, k.TeamID, k.UserID); err != nil {
			return err
		}
		if err := tx.KeyInsert(ctx, &k, sec); err != nil {
			return err
		}
		return setKeyFallbacks(ctx, tx, &k, nil, want.GetFallbacks())
	})
	return reply(&adminv1.CreateKeyResponse{Key: out, Token: tok}, err)
}

func (s *keyService) GetKey(ctx context.Context, req *connect.Request[adminv1.GetKeyRequest]) (*connect.Response[adminv1.GetKeyResponse], error) {
	out, err := getObject(ctx, s.store, keyObjects, req.Msg.GetId())
	return reply(&adminv1.GetKeyResponse{Key: out}, err)
}

func (s *keyService) ListKeys(ctx context.Context, req *connect.Request[adminv1.ListKeysRequest]) (*connect.Response[adminv1.ListKeysResponse], error) {
	p := principal(ctx)
	t := tenant(ctx)
	m := req.Msg
	orgID, teamID := m.GetOrgId(), m.GetTeamId()
	if orgID == "" {
		orgID = t.OrgID // "" for platform tokens: every org
	}
	if teamID == "" {
		teamID = t.TeamID
	}
	target := authz.PlatformTarget("keys of every org")
	switch {
	case orgID != "" && teamID != "":
		target = authz.TeamTarget(orgID, teamID, "keys of team "+teamID)
	case orgID != "":
		target = authz.TeamTarget(orgID, "", "keys of org "+orgID)
	}
	// A filter naming another org or team than the caller's is refused
	// here (the tenant filter alone would make it silently empty).
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	c := &validator{}
	if m.GetTag() != "" && !tagPattern.MatchString(m.GetTag()) {
		c.add("tag", "must be 1–%d characters of A-Z a-z 0-9 _ . : / -", maxKeyTagLen)
	}
	if utf8.RuneCountInString(m.GetAliasPrefix()) > maxKeyLabelLen {
		c.add("alias_prefix", "must be at most %d characters", maxKeyLabelLen)
	}
	if len(m.GetUserId()) > maxRefIDLen {
		c.add("user_id", "must be at most %d characters", maxRefIDLen)
	}
	if err := c.err(); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.KeyList(ctx, store.Tenant{OrgID: orgID, TeamID: teamID}, store.KeyQuery{
		UserID: m.GetUserId(), AliasPrefix: m.GetAliasPrefix(), Blocked: m.Blocked, Tag: m.GetTag(),
	}, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListKeysResponse{}
	resp.Keys, resp.NextPageToken, err = page(rows, limit, keyToProto, func(k store.Key) string { return k.ID })
	return reply(resp, err)
}

// lockKey loads key id for a change and authorises it.
func lockKey(ctx context.Context, tx *store.Tx, id string) (store.Key, *adminv1.Key, error) {
	cur, err := keyObjects.locked(ctx, tx, id, events.OpUpsert)
	if err != nil {
		return store.Key{}, nil, err
	}
	before, err := keyToProto(cur)
	if err != nil {
		return store.Key{}, nil, err
	}
	return cur, before, nil
}

func (s *keyService) UpdateKey(ctx context.Context, req *connect.Request[adminv1.UpdateKeyRequest]) (*connect.Response[adminv1.UpdateKeyResponse], error) {
	if err := keyWriteGate(ctx); err != nil {
		return nil, err
	}
	id := req.Msg.GetKey().GetId()
	settingExpiry := false
	for _, path := range req.Msg.GetUpdateMask().GetPaths() {
		settingExpiry = settingExpiry || path == "expire_time"
	}
	var out *adminv1.Key
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, before, err := lockKey(ctx, tx, id)
		if err != nil {
			return err
		}
		after := proto.Clone(before).(*adminv1.Key)
		if err := applyMask(after, req.Msg.GetKey(), req.Msg.GetUpdateMask(), keyUpdatable...); err != nil {
			return err
		}
		if err := validateKey(after, tx.Now(), settingExpiry, after.GetProject() != before.GetProject()); err != nil {
			return err
		}
		if after.GetUserId() != before.GetUserId() && after.GetUserId() != "" {
			// Re-owning a team key: the new owner must be a member.
			if err := tx.KeyCheckRefs(ctx, cur.OrgID, cur.TeamID, after.GetUserId()); err != nil {
				return err
			}
		}
		keySettings(&cur, after)
		if err := tx.KeyUpdate(ctx, &cur); err != nil {
			return err
		}
		if err := setKeyFallbacks(ctx, tx, &cur, before.GetFallbacks(), after.GetFallbacks()); err != nil {
			return err
		}
		if out, err = keyToProto(cur); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionUpdated, objKey, cur.ID, cur.OrgID, cur.TeamID, auditJSON(before), auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.KeyUpserted, cur.OrgID, cur.ID, nil)
	})
	return reply(&adminv1.UpdateKeyResponse{Key: out}, err)
}

func (s *keyService) DeleteKey(ctx context.Context, req *connect.Request[adminv1.DeleteKeyRequest]) (*connect.Response[adminv1.DeleteKeyResponse], error) {
	return reply(&adminv1.DeleteKeyResponse{}, deleteObject(ctx, s.store, keyObjects, req.Msg.GetId()))
}

func (s *keyService) RotateKey(ctx context.Context, req *connect.Request[adminv1.RotateKeyRequest]) (*connect.Response[adminv1.RotateKeyResponse], error) {
	if err := keyWriteGate(ctx); err != nil {
		return nil, err
	}
	// Parsed before anything is opened: a bad grace period rotates nothing.
	grace, err := parseGracePeriod(req.Msg.GetGracePeriod())
	if err != nil {
		return nil, err
	}
	tok, sec := s.newKeySecret()
	resp := &adminv1.RotateKeyResponse{Token: tok}
	err = s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, before, err := lockKey(ctx, tx, req.Msg.GetId())
		if err != nil {
			return err
		}
		var until *time.Time
		var payload events.KeyRotatedPayload
		if grace > 0 {
			u := tx.Now().Add(grace).Truncate(time.Microsecond) // Postgres precision
			until = &u
			payload.GraceUntil = u.Format(time.RFC3339Nano)
			resp.OldTokenValidUntil = timestamppb.New(u)
		}
		if err := tx.KeyRotate(ctx, &cur, sec, until); err != nil {
			return err
		}
		if resp.Key, err = keyToProto(cur); err != nil {
			return err
		}
		after, err := rotationAfter(resp.Key, grace, until)
		if err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionRotated, objKey, cur.ID, cur.OrgID, cur.TeamID, auditJSON(before), after); err != nil {
			return err
		}
		return outbox(ctx, tx, events.KeyRotated, cur.OrgID, cur.ID, payload)
	})
	return reply(resp, err)
}

// keyObjects is the object of Create/Block/Unblock/DeleteKey.
var keyObjects = mutable[store.Key, *adminv1.Key]{
	object:       events.ObjKey,
	get:          (*store.Store).KeyGet,
	getForUpdate: (*store.Tx).KeyGetForUpdate,
	target:       keyTarget,
	set: func(ctx context.Context, tx *store.Tx, cur *store.Key, b bool) error {
		return tx.KeySetBlocked(ctx, cur, b)
	},
	remove: func(ctx context.Context, tx *store.Tx, cur store.Key) (any, error) {
		return nil, tx.KeyDelete(ctx, cur.ID)
	},
	toProto: keyToProto,
	scope:   func(k store.Key) (string, string, string) { return k.ID, k.OrgID, k.TeamID },
}

func (s *keyService) BlockKey(ctx context.Context, req *connect.Request[adminv1.BlockKeyRequest]) (*connect.Response[adminv1.BlockKeyResponse], error) {
	k, err := setBlocked(ctx, s.store, keyObjects, req.Msg.GetId(), true)
	return reply(&adminv1.BlockKeyResponse{Key: k}, err)
}

func (s *keyService) UnblockKey(ctx context.Context, req *connect.Request[adminv1.UnblockKeyRequest]) (*connect.Response[adminv1.UnblockKeyResponse], error) {
	k, err := setBlocked(ctx, s.store, keyObjects, req.Msg.GetId(), false)
	return reply(&adminv1.UnblockKeyResponse{Key: k}, err)
}

// setKeyFallbacks stores k's fallback overrides when they change from
// before, after checking them against the model groups (fallbacks.go).
func setKeyFallbacks(ctx context.Context, tx *store.Tx, k *store.Key, before, after map[string]*adminv1.ModelGroupFallbacks) error {
	return setOverrides(ctx, tx, before, after, func(f store.Fallbacks) error { return tx.KeyFallbacksSet(ctx, k, f) })
}
