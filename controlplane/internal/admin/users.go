package admin

import "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"

// userService implements UserService.
type userService struct {
	*Server
	adminv1connect.UnimplementedUserServiceHandler
}
